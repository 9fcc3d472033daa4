"""``verify --against`` another checkpoint than the store's source: one line and the summary."""

from __future__ import annotations

from pathlib import Path

import ucformat
from tests.cli.helpers import invoke

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"


def test_verify_against_a_foreign_checkpoint_says_so_in_one_line(tmp_path: Path) -> None:
    store = tmp_path / "a.ucf"
    ucformat.convert(DATA / "z2-fp32-dsadam-ftb-ws3" / "ckpt", store)
    foreign = DATA / "z3-fp16-tadam-multi-ws2" / "ckpt"
    result = invoke("verify", str(store), "--against", str(foreign))
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 2, result.output
    assert lines[0] == (
        f"ucformat.json: {foreign} is not the checkpoint this store was converted from: 8 of "
        "its 8 parameters are not in the store and 7 of the store's 7 are not in it (e.g. "
        "'down.bias' only in the store); its values were not compared."
    )
    shards = sum(1 for p in Path(store).rglob("c.*") if p.is_file())
    assert lines[1].startswith(f"FAILED: {store}: 1 problem(s); 20 arrays, {shards} shards")


def test_verify_against_its_own_source_still_passes(tmp_path: Path) -> None:
    store = tmp_path / "a.ucf"
    source = DATA / "z2-fp32-dsadam-ftb-ws3" / "ckpt"
    ucformat.convert(source, store)
    result = invoke("verify", str(store), "--against", str(source))
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"ok: {store}")
