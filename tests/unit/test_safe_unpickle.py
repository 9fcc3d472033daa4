"""Hostile pickles are refused before anything runs; real torch files decode lazily."""

from __future__ import annotations

import builtins
import collections
import os
import subprocess
from pathlib import Path

import pytest
import torch

from ucformat.errors import TruncatedFileError, UnsafePickleError
from ucformat.sources.safe_unpickle import PicklePolicy
from ucformat.sources.torchfile import TensorRef, open_torch_file


class Payload:
    """Pickles as a call of ``func(*args)``: the classic code-execution trick."""

    def __init__(self, func: object, *args: object) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.func, self.args


def _attacks(sentinel: Path) -> dict[str, object]:
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


ATTACK_NAMES = list(_attacks(Path("x")))
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


@pytest.mark.parametrize("attack", ATTACK_NAMES)
def test_hostile_torch_file_is_refused_and_nothing_runs(tmp_path: Path, attack: str) -> None:
    sentinel = tmp_path / "PWNED"
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": _attacks(sentinel)[attack]}, path)
    with pytest.raises(UnsafePickleError) as caught:
        open_torch_file(path)
    message = str(caught.value)
    assert str(path) in message
    assert f"{EXPECTED_GLOBAL[attack]}', which is not on ucformat's allow-list" in message
    assert "nothing was executed" in message
    assert "\n" not in message
    assert not sentinel.exists()


def test_opaque_policy_still_executes_nothing(tmp_path: Path) -> None:
    sentinel = tmp_path / "PWNED"
    path = tmp_path / "f.pt"
    torch.save({"x": Payload(os.system, f"touch {sentinel}")}, path)
    handle = open_torch_file(path, PicklePolicy(all_unknown_opaque=True))
    assert type(handle.obj["x"]).ucformat_qualname == "posix.system"
    assert not sentinel.exists()
    handle.close()


def test_real_tensors_decode_lazily_and_exactly(tmp_path: Path) -> None:
    path = tmp_path / "t.pt"
    big = torch.arange(24, dtype=torch.float32)
    state = {
        "flat": big,
        "view": big[4:10],
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "step": torch.tensor(4.0),
        "int": 7,
        "shape": torch.Size([2, 3]),
        "transposed": torch.arange(6.0).reshape(2, 3).t(),
        "param": torch.nn.Parameter(torch.ones(2)),
    }
    torch.save(state, path)
    with open_torch_file(path) as handle:
        obj = handle.obj
        assert isinstance(obj["flat"], TensorRef)
        assert obj["shape"] == (2, 3) and obj["int"] == 7
        for key in ("flat", "view", "bf16", "step", "transposed", "param"):
            loaded = obj[key].load()
            assert loaded.dtype == state[key].dtype and torch.equal(loaded, state[key].detach()), (
                key
            )
        out = torch.empty(3, dtype=torch.float32).numpy()
        obj["view"].read_into(out, 2, 5)
        assert out.tolist() == [6.0, 7.0, 8.0]


def test_truncated_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"a": torch.zeros(1000)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TruncatedFileError, match="not a complete zip archive"):
        open_torch_file(path)


def test_not_a_torch_file(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    path.write_text("hello")
    with pytest.raises(TruncatedFileError, match="x.pt: not a complete zip archive"):
        open_torch_file(path)
