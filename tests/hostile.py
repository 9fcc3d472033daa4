"""Crafted pickles that run code when loaded by Python's or torch's own unpickler.

Each attack touches a *sentinel* file if it ever runs; tests check that the file never appears.
"""

from __future__ import annotations

import builtins
import collections
import io
import os
import pickle
import subprocess
import zipfile
from pathlib import Path

import torch


class Payload:
    """Pickles as a call of ``func(*args)``: the classic ``__reduce__`` code-execution trick."""

    def __init__(self, func: object, *args: object) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.func, self.args


def attacks(sentinel: Path) -> dict[str, object]:
    """Objects whose unpickling would create ``sentinel``, by the attack's name."""
    touch = f"touch {sentinel}"
    return {
        "os.system": Payload(os.system, touch),
        "subprocess.call": Payload(subprocess.call, ["touch", str(sentinel)]),
        "subprocess.Popen": Payload(subprocess.Popen, ["touch", str(sentinel)]),
        "builtins.eval": Payload(builtins.eval, f"__import__('os').system({touch!r})"),
        "builtins.exec": Payload(builtins.exec, f"import os; os.system({touch!r})"),
        "builtins.getattr": Payload(builtins.getattr, Payload(builtins.__import__, "os"), "system"),
        "nested in a state dict": collections.OrderedDict(
            weight=torch.ones(3), extra={"deep": [Payload(os.system, touch)]}
        ),
    }


ATTACK_NAMES = list(attacks(Path("x")))

#: The global each attack's pickle names (pickle may find a function under another module).
EXPECTED_GLOBAL = {
    "os.system": ".system",
    "subprocess.call": ".call",
    "subprocess.Popen": ".Popen",
    "builtins.eval": "builtins.eval",
    "builtins.exec": "builtins.exec",
    "builtins.getattr": "builtins.getattr",
    "nested in a state dict": ".system",
}

#: The same for a data.pkl written by plain ``pickle`` (see :func:`replace_data_pkl`): there a
#: tensor is stored through ``torch.storage._load_from_bytes``, which calls ``torch.load`` on
#: bytes from the file, and is refused before the payload behind it.
EXPECTED_GLOBAL_PLAIN_PICKLE = {
    **EXPECTED_GLOBAL,
    "nested in a state dict": "torch.storage._load_from_bytes",
}


def replace_data_pkl(path: Path, payload: object) -> None:
    """Rewrite the torch zip at ``path`` with ``payload`` pickled as its ``data.pkl``.

    Every other entry (tensor storages, version records) is kept, so the file is still a
    well-formed ``torch.save`` archive; only its object tree is hostile.
    """
    buffer = io.BytesIO()
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as out:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith("/data.pkl"):
                data = pickle.dumps(payload, protocol=2)
            out.writestr(info, data)
    path.write_bytes(buffer.getvalue())
