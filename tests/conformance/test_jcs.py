"""ucformat.format.jcs against RFC 8785's own examples and an independent implementation
(``rfc8785``)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from ucformat.format.jcs import CanonicalizationError, canonicalize, format_number, parse

GOLDEN = Path(__file__).parent / "golden"

# RFC 8785 Appendix B: IEEE-754 bit patterns and their canonical text.
RFC_NUMBERS = [
    ("0000000000000000", "0"),
    ("8000000000000000", "0"),
    ("0000000000000001", "5e-324"),
    ("8000000000000001", "-5e-324"),
    ("7fefffffffffffff", "1.7976931348623157e+308"),
    ("ffefffffffffffff", "-1.7976931348623157e+308"),
    ("4340000000000000", "9007199254740992"),
    ("c340000000000000", "-9007199254740992"),
    ("4430000000000000", "295147905179352830000"),
    ("44b52d02c7e14af5", "9.999999999999997e+22"),
    ("44b52d02c7e14af6", "1e+23"),
    ("44b52d02c7e14af7", "1.0000000000000001e+23"),
    ("444b1ae4d6e2ef4e", "999999999999999700000"),
    ("444b1ae4d6e2ef4f", "999999999999999900000"),
    ("444b1ae4d6e2ef50", "1e+21"),
    ("3eb0c6f7a0b5ed8c", "9.999999999999997e-7"),
    ("3eb0c6f7a0b5ed8d", "0.000001"),
    ("41b3de4355555553", "333333333.3333332"),
    ("41b3de4355555554", "333333333.33333325"),
    ("41b3de4355555555", "333333333.3333333"),
    ("41b3de4355555556", "333333333.3333334"),
    ("41b3de4355555557", "333333333.33333343"),
    ("becbf647612f3696", "-0.0000033333333333333333"),
    ("43143ff3c1cb0959", "1424953923781206.2"),
]


@pytest.mark.parametrize(("bits", "text"), RFC_NUMBERS)
def test_rfc_number_examples(bits: str, text: str) -> None:
    (value,) = struct.unpack(">d", bytes.fromhex(bits))
    assert format_number(value) == text
    assert rfc8785.dumps(value) == text.encode()


def test_rfc_sample_object() -> None:
    # RFC 8785 §3.2.3's input and output, verbatim.
    source = (
        '{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],'
        ' "string": "\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022\\u005c\\\\\\"\\/",'
        ' "literals": [null, true, false]}'
    )
    expected = (
        '{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],'
        '"string":"€$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
    ).encode()
    assert canonicalize(json.loads(source)) == expected


def test_utf16_member_order() -> None:
    # RFC 8785 §3.2.3: names sort by UTF-16 code units, so U+1F600 (a surrogate pair, 0xD83D...)
    # sorts before U+FB33 although its code point is larger.
    value = {"\u20ac": 1, "\r": 2, "\ufb33": 3, "1": 4, "\U0001f600": 5, "\x80": 6, "\xf6": 7}
    got = canonicalize(value).decode()
    assert got == rfc8785.dumps(value).decode()
    order = list(json.loads(got))
    assert order == ["\r", "1", "\x80", "\xf6", "\u20ac", "\U0001f600", "\ufb33"]


@pytest.mark.parametrize(
    "value", [math.nan, math.inf, -math.inf, 2**53, -(2**53), {1: 2}, b"x", "\ud800", object()]
)
def test_refused(value: object) -> None:
    with pytest.raises(CanonicalizationError):
        canonicalize(value)


def test_real_manifests_match_rfc8785() -> None:
    manifests = sorted(GOLDEN.glob("*/ucformat.json"))
    assert manifests, "the golden stores are missing"
    for path in manifests:
        document = json.loads(path.read_bytes())
        assert canonicalize(document) == rfc8785.dumps(document), path


_floats = st.floats(allow_nan=False, allow_infinity=False)
_tricky_floats = st.one_of(
    _floats,
    st.integers(-1074, 1023).map(lambda e: math.ldexp(1.0, e)),
    st.integers(0, 2**64 - 1).map(lambda b: struct.unpack("<d", b.to_bytes(8, "little"))[0]),
    st.sampled_from([1e21, 1e-7, 1e-6, 0.1, 1e-8, 123456789012345680000.0, 5e-324, -0.0]),
).filter(math.isfinite)
_strings = st.text(st.characters(codec="utf-8"), max_size=12)  # no lone surrogates
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**53) + 1, 2**53 - 1),
    _tricky_floats,
    _strings,
)
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(_strings, inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(_tricky_floats)
def test_numbers_match_rfc8785(value: float) -> None:
    text = format_number(value)
    assert text.encode() == rfc8785.dumps(value)
    assert float(text) == value  # and it reads back as the same double


@settings(max_examples=300, deadline=None)
@given(_json)
def test_values_match_rfc8785(value: object) -> None:
    got = canonicalize(value)
    assert got == rfc8785.dumps(value)
    assert json.loads(got, parse_int=float) == value  # and it means the same value


#: Text where the fast way must give way: floats inside strings, between the delimiters a
#: number has; 16 digits in a row; characters outside the BMP; escaped surrogates.
_float_text = st.sampled_from(["1e-05", ":1e-05,", ",1.0]", "[-0.0}", ":1e+21,", "5e-324"])
_awkward = st.one_of(
    _json,
    st.lists(st.one_of(_tricky_floats, _float_text, st.just("\U0001f600"), st.just("\ue000"),
                       st.just(1234567890123456)), max_size=6),
    st.dictionaries(st.one_of(_strings, st.sampled_from(["\U0001f600", "\ue000", "1.0"])),
                    st.one_of(_tricky_floats, _float_text), max_size=6),
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(_awkward, st.booleans(), st.integers(0, 2))
def test_parsed_values_take_the_fast_way_to_the_same_bytes(
    value: object, ascii_escapes: bool, indent: int
) -> None:
    """JSON text parsed by ``parse``, its census passed on: the bytes of the general code and
    of rfc8785, however the text was written (escapes, indentation)."""
    payload = json.dumps(value, ensure_ascii=ascii_escapes, indent=indent or None).encode()
    parsed, census = parse(payload)
    assert parsed == json.loads(payload)
    assert canonicalize(parsed, census) == canonicalize(parsed) == rfc8785.dumps(parsed)
    body = {"value": parsed, "digest": None}  # a member replaced, as a digest does
    assert canonicalize(body, census) == canonicalize(body)


def test_the_fast_way_rewrites_floats_and_leaves_strings_alone() -> None:
    payload = b'{"lr": 1e-05, "eps": 1E-8, "name": ":1e-05,", "big": 1e21, "zero": -0.0}'
    parsed, census = parse(payload)
    assert census == {"1e-05": 1, "1e-08": 1, "1e+21": 1, "-0.0": 1}
    assert canonicalize(parsed, census) == (
        b'{"big":1e+21,"eps":1e-8,"lr":0.00001,"name":":1e-05,","zero":0}'
    )
    assert parse(b"[1234567890123456]")[1] is None  # maybe beyond 2**53: the general code
    assert parse('["\U0001f600"]'.encode())[1] is None
    assert parse(b'["\\ud83d\\ude00"]')[1] is None
    with pytest.raises(CanonicalizationError, match="integer"):
        canonicalize(*parse(b"[12345678901234567890]"))
    with pytest.raises(CanonicalizationError, match="NaN"):
        canonicalize(*parse(b"[NaN]"))


def test_worked_example_of_the_spec() -> None:
    """docs/format.md §3.7: the example object, its canonical bytes and digest, as printed."""
    import hashlib
    import re

    text = (Path(__file__).parents[2] / "docs" / "format.md").read_text()
    section = text[text.index("**Worked example.**") : text.index("**Format 1**")]
    blocks = re.findall(r"```(?:json)?\n(.*?)```", section, flags=re.S)
    document = json.loads(blocks[0].replace("sha256:…", "sha256:anything"))
    canonical = blocks[1].strip().encode()
    assert canonicalize({**document, "digest": None}) == canonical
    assert rfc8785.dumps({**document, "digest": None}) == canonical
    assert f"these {len(canonical)} bytes" in section
    digest = "sha256:" + hashlib.sha256(canonical).hexdigest()
    assert f"`{digest}`" in section
