"""RFC 8785 JSON Canonicalization Scheme (JCS): one byte string per JSON value.

The digest of a format-2 manifest (docs/format.md §3.7) is the SHA-256 of these bytes, so any
language can recompute it: objects have their members sorted by the UTF-16 code units of their
names, no whitespace is written, strings are escaped minimally and the text is UTF-8, and numbers
are written as ECMAScript's ``Number.prototype.toString`` writes an IEEE-754 double.

Input is the Python form of parsed JSON (``dict`` with ``str`` keys, ``list``, ``str``, ``int``,
``float``, ``bool``, ``None``). Integers are JSON numbers, that is doubles: one outside
``±(2**53 - 1)`` has no exact canonical form and is refused, as are NaN, infinities and strings
holding lone surrogates (not Unicode scalar values). Stdlib only.

A value parsed from JSON text by :func:`parse` comes with a census of its floats, and with it
:func:`canonicalize` writes the same bytes through the C encoder of :mod:`json` (a 56 MiB
manifest: about 1.5 s instead of 10 s): sorted keys, no whitespace, the escapes RFC 8785 asks
for, and each float rewritten from Python's ``repr`` to ECMAScript's form where they differ.
Where the text could make the two differ (characters outside the Basic Multilingual Plane or
escaped surrogates, whose UTF-16 order is not their code point order; a run of 16 or more
digits, which may be an integer no double holds; a float written where a string holds the same
characters between the same delimiters) the census is absent or the check fails, and the value
is written by the general code.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "MAX_SAFE_INTEGER",
    "CanonicalizationError",
    "FloatCensus",
    "canonicalize",
    "format_number",
    "parse",
]

#: Largest integer every double-based JSON parser reads exactly (I-JSON, RFC 7493 §2.2).
MAX_SAFE_INTEGER = 2**53 - 1

#: A character :func:`_quote` must escape: ``"``, ``\\`` or a C0 control.
_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f]')
_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r",
                  "\t": "\\t"}  # fmt: skip


#: Of a value parsed from JSON text: how many float tokens it holds, by the ``repr`` of each
#: token's value (what :func:`json.dumps` writes for it).
FloatCensus = Counter[str]

#: Every digit to ``0``: 16 digits in a row become one search for 16 zeros.
_DIGITS_TO_ZERO = bytes.maketrans(b"0123456789", b"0" * 10)
#: A 4-byte UTF-8 sequence's first byte (a character outside the BMP), an escaped surrogate.
_NOT_BMP = re.compile(rb"[\xf0-\xff]|\\u[dD][89abAB]")


class CanonicalizationError(ValueError):
    """The value has no RFC 8785 form (non-finite number, unsafe integer, lone surrogate...)."""


def parse(payload: bytes) -> tuple[Any, FloatCensus | None]:
    """``json.loads(payload)`` and its floats' census, or None where the text is not plain
    (module docstring): the census lets :func:`canonicalize` take the fast way.

    Raises:
        UnicodeDecodeError, json.JSONDecodeError, RecursionError: as :func:`json.loads`.
    """
    census: FloatCensus = Counter()

    def read_float(token: str) -> float:
        number = float(token)
        census[repr(number)] += 1
        return number

    value = json.loads(payload, parse_float=read_float)
    return value, (census if _plain(payload) else None)


def _plain(payload: bytes) -> bool:
    """Whether :func:`json.dumps` writes the canonical form of ``payload``'s value (module
    docstring): only BMP characters, no escaped surrogate, no 16 digits in a row."""
    if b"0" * 16 in payload.translate(_DIGITS_TO_ZERO):
        return False
    if payload.isascii() and b"\\u" not in payload:
        return True
    return _NOT_BMP.search(payload) is None


def canonicalize(value: Any, census: FloatCensus | None = None) -> bytes:
    """The RFC 8785 canonical UTF-8 bytes of the JSON value ``value``.

    Args:
        value: the Python form of a JSON value.
        census: where ``value`` is what :func:`parse` returned (members may be replaced by
            values other than floats), the census it returned with it: the same bytes, faster.

    Raises:
        CanonicalizationError: ``value`` holds something JSON cannot carry exactly.
    """
    if census is not None:
        fast = _canonicalize_parsed(value, census)
        if fast is not None:
            return fast
    parts: list[str] = []
    _emit(value, parts)
    text = "".join(parts)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise CanonicalizationError(
            "a string holds a lone UTF-16 surrogate, which is not a Unicode character"
        ) from None


def _canonicalize_parsed(value: Any, census: FloatCensus) -> bytes | None:
    """The canonical bytes by :func:`json.dumps`, or None where that cannot be shown equal."""
    if any(written in ("nan", "inf", "-inf") for written in census):
        return None  # the general code names the problem
    try:
        text = json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, ValueError):
        return None
    for written, count in census.items():
        wanted = format_number(float(written))
        if wanted == written:
            continue
        token = re.compile(r"(?<=[:,\[])" + re.escape(written) + r"(?=[,\]}])")
        text, found = token.subn(wanted, text)
        if found != count:  # a string holds the same text, or a float was replaced
            return None
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return None


def _emit(value: Any, out: list[str]) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, str):
        out.append(_quote(value))
    elif isinstance(value, int):
        if abs(value) > MAX_SAFE_INTEGER:
            raise CanonicalizationError(
                f"integer {value} is outside ±(2**53 - 1): JSON parsers read it as a rounded "
                "double, so it has no exact canonical form"
            )
        out.append(str(int(value)))
    elif isinstance(value, float):
        out.append(format_number(value))
    elif isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise CanonicalizationError(f"object member name {key!r} is not a string")
        out.append("{")
        for index, key in enumerate(sorted(value, key=_utf16_units)):
            if index:
                out.append(",")
            out.append(_quote(key))
            out.append(":")
            _emit(value[key], out)
        out.append("}")
    elif isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        out.append("[")
        for index, item in enumerate(value):
            if index:
                out.append(",")
            _emit(item, out)
        out.append("]")
    else:
        raise CanonicalizationError(f"{type(value).__name__} is not a JSON value")


def _utf16_units(name: str) -> bytes:
    """Sort key: the name's UTF-16 code units, compared as unsigned 16-bit numbers."""
    return name.encode("utf-16-be", "surrogatepass")


def _quote(text: str) -> str:
    """A JSON string literal: only ``"``, ``\\`` and C0 controls escaped (RFC 8785 §3.2.2.2)."""
    if _NEEDS_ESCAPE.search(text) is None:  # most names: nothing to escape
        return '"' + text + '"'
    pieces = ['"']
    for char in text:
        escaped = _SHORT_ESCAPES.get(char)
        if escaped is not None:
            pieces.append(escaped)
        elif char < " ":
            pieces.append(f"\\u{ord(char):04x}")
        else:
            pieces.append(char)
    pieces.append('"')
    return "".join(pieces)


def format_number(number: float) -> str:
    """``Number.prototype.toString`` of a finite double (ECMA-262 Number::toString, radix 10).

    With ``s`` the shortest digit string that reads back as ``number``, ``k`` its length and
    ``n`` such that ``number = s * 10**(n - k)``: integers up to 21 digits are written out,
    ``0 < n <= 21`` puts the point inside the digits, ``-6 < n <= 0`` writes ``0.000ddd``, and
    anything else is ``d[.ddd]e±x``. Negative zero is ``0``.

    Raises:
        CanonicalizationError: ``number`` is NaN or infinite.
    """
    if not math.isfinite(number):
        raise CanonicalizationError(f"{number} is not a JSON number (NaN and infinities are not)")
    if number == 0:
        return "0"
    sign = "-" if number < 0 else ""
    mantissa, _, exponent = repr(abs(number)).partition("e")  # repr: the shortest round trip
    whole, _, fraction = mantissa.partition(".")
    digits = (whole + fraction).lstrip("0")
    point = len(whole) + (int(exponent) if exponent else 0)  # decimal point after `point` digits
    point -= len(whole + fraction) - len((whole + fraction).lstrip("0"))
    digits = digits.rstrip("0")
    k, n = len(digits), point
    if k <= n <= 21:
        body = digits + "0" * (n - k)
    elif 0 < n <= 21:
        body = f"{digits[:n]}.{digits[n:]}"
    elif -6 < n <= 0:
        body = "0." + "0" * -n + digits
    else:
        power = n - 1
        mark = "+" if power >= 0 else "-"
        head = digits[0] if k == 1 else f"{digits[0]}.{digits[1:]}"
        body = f"{head}e{mark}{abs(power)}"
    return sign + body
