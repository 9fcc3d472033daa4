"""Hostile pickles are refused before anything runs; real torch files decode lazily."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.hostile import ATTACK_NAMES, EXPECTED_GLOBAL, Payload, attacks
from ucformat.errors import TruncatedFileError, UnsafePickleError
from ucformat.sources.safe_unpickle import PicklePolicy
from ucformat.sources.torchfile import TensorRef, open_torch_file


@pytest.mark.parametrize("attack", ATTACK_NAMES)
def test_hostile_torch_file_is_refused_and_nothing_runs(tmp_path: Path, attack: str) -> None:
    sentinel = tmp_path / "PWNED"
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": attacks(sentinel)[attack]}, path)
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


SCALAR_VALUES = [
    torch.tensor(3.14159, dtype=torch.bfloat16),
    torch.tensor(-0.0, dtype=torch.bfloat16),
    torch.tensor(float("inf"), dtype=torch.bfloat16),
    torch.tensor(65504.0, dtype=torch.float16),
    torch.tensor(1 / 3, dtype=torch.float32),
    torch.tensor(1 / 3, dtype=torch.float64),
    torch.tensor(2**40 + 1, dtype=torch.int64),
    torch.tensor(-7, dtype=torch.int8),
    torch.tensor(True),
    torch.arange(5.0, dtype=torch.bfloat16)[3],  # a view at an offset into a larger storage
]


def test_item_reads_scalars_exactly_without_torch(tmp_path: Path) -> None:
    path = tmp_path / "scalars.pt"
    torch.save(SCALAR_VALUES, path)
    with open_torch_file(path) as handle:
        for ref, tensor in zip(handle.obj, SCALAR_VALUES, strict=True):
            value = ref.item()
            assert type(value) is type(tensor.item()), tensor
            assert str(value) == str(tensor.item()), tensor  # -0.0 and inf too
            assert ref.dtype_name == str(tensor.dtype).removeprefix("torch."), tensor


def test_reading_a_checkpoint_does_not_import_torch(tmp_path: Path) -> None:
    """Conversion start-up and memory stay low: the source reader never needs torch itself."""
    path = tmp_path / "state.pt"
    torch.save({"flat": torch.arange(6.0).to(torch.bfloat16), "step": torch.tensor(2.0)}, path)
    script = (
        "import sys\n"
        "from ucformat.sources.torchfile import open_torch_file\n"
        f"with open_torch_file(__import__('pathlib').Path({str(path)!r})) as handle:\n"
        "    out = __import__('numpy').empty(6, dtype='uint16')\n"
        "    handle.obj['flat'].read_into(out, 0, 6)\n"
        "    print(handle.obj['step'].item(), out.tolist())\n"
        "assert 'torch' not in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    bits = torch.arange(6.0).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    assert done.stdout.split(" ", 1) == ["2.0", f"{bits.tolist()}\n"]


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
    with pytest.raises(TruncatedFileError, match=r"x\.pt: not a complete zip archive"):
        open_torch_file(path)


def test_dcp_metadata_admits_planner_dataclasses_inertly() -> None:
    """Megatron-Core's torch_dist ``.metadata`` keeps every rank's SavePlan: admitted as attribute
    holders (WriteItemType as its number); other planner names stay refused."""
    from ucformat.sources.safe_unpickle import StandIn, load_dcp_metadata_pickle

    module = b"ctorch.distributed.checkpoint.planner\n"
    plan = load_dcp_metadata_pickle(
        b"\x80\x04" + module + b"SavePlan\n)R}X\x05\x00\x00\x00itemsK\x02sb.", source="t"
    )
    assert isinstance(plan, StandIn) and plan.attributes() == {"items": 2}
    assert type(plan).ucformat_qualname.endswith("planner.SavePlan")
    kind = load_dcp_metadata_pickle(
        b"\x80\x04" + module + b"WriteItemType\nK\x02\x85R.", source="t"
    )
    assert kind == 2
    with pytest.raises(UnsafePickleError, match=r"planner\.LoadPlan"):
        load_dcp_metadata_pickle(b"\x80\x04" + module + b"LoadPlan\n)R.", source="t")
