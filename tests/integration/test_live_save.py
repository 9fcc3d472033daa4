"""``ucformat.deepspeed.save`` / ``save_async`` from live engines (CPU, gloo, torchrun).

For a representative set of the fixture grid's cases (every stage and dtype, BF16_Optimizer,
ZeRO-3 sub-groups, frozen/tied params and buffers, two param groups, parameter alignment, uneven
world sizes), the worker trains the case's engine as the grid does, then saves it BOTH with
``engine.save_checkpoint`` (+ ``ucformat.convert``) and with ``ucformat.deepspeed.save``: every
object of the two stores must be byte-identical, the manifests equal apart from provenance.
The live stores are then loaded at another world size and stage by the grid's own load worker
and compared with the truth recorded from the saving engine. In the ``warm`` cases the engine
was saved live one step earlier: the compared save takes the plan kept from that one.

Faults: a rank SIGKILLed while writing (``save`` and ``save_async``) leaves a store that does
not open and that ``verify`` reports; a rank whose writes fail (``RLIMIT_FSIZE``: EFBIG) makes
every rank raise one ``CollectiveError`` naming it, and leaves no store; a rank that does
not answer is named by the others within the agreement timeout; save and save_async to the
local S3 server write the objects a local save writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner
from ucformat_cli.main import app

import ucformat
from tests.fixtures.load_cases import LoadCase
from tests.fixtures.run_live_saves import LiveSave, load_live_stores, run_fault, run_live_saves
from ucformat.errors import IncompleteStoreError, NotAStoreError, SourceNotFoundError
from ucformat.store.staged_local import staging_path

pytestmark = pytest.mark.deepspeed

SAVES = [
    LiveSave("z1-bf16-dsadam-simple-ws2"),
    LiveSave("z1-fp16-tadam-ftb-ws2", warm=True),
    LiveSave("z1-bf16-tadam-multi-ws2-bf16opt", warm=True),
    LiveSave("z2-fp16-dsadam-ftb-ws2"),
    LiveSave("z2-fp32-dsadam-multi-ws2-palign"),
    LiveSave("z3-fp32-dsadam-multi-ws2-sg12", warm=True),
    LiveSave("z3-bf16-dsadam-ftb-ws2", "async", warm=True),
    LiveSave("z2-bf16-tadam-multi-ws2", "async"),
    LiveSave("z3-fp16-tadam-ftb-ws3"),
    LiveSave("z1-fp32-dsadam-simple-ws3", "async"),
]
#: Each live store loaded at another world size and ZeRO stage.
LOADS = [
    (SAVES[2], LoadCase("z1-bf16-tadam-multi-ws2-bf16opt", 3, 2)),
    (SAVES[3], LoadCase("z2-fp16-dsadam-ftb-ws2", 3, 3)),
    (SAVES[5], LoadCase("z3-fp32-dsadam-multi-ws2-sg12", 3, 1)),
    (SAVES[6], LoadCase("z3-bf16-dsadam-ftb-ws2", 3, 2)),
    (SAVES[8], LoadCase("z3-fp16-tadam-ftb-ws3", 2, 1)),
    (SAVES[9], LoadCase("z1-fp32-dsadam-simple-ws3", 2, 3)),
]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, ds_grid: Path) -> Path:
    return tmp_path_factory.mktemp("live")


@pytest.fixture(scope="module")
def saves(work: Path) -> dict[str, dict[str, Any]]:
    return run_live_saves(SAVES, work)


@pytest.fixture(scope="module")
def loads(saves: dict[str, dict[str, Any]], work: Path) -> dict[str, dict[str, Any]]:
    return load_live_stores(LOADS, work)


@pytest.mark.parametrize("name", [save.name for save in SAVES])
def test_live_save_equals_convert_of_save_checkpoint(
    name: str, saves: dict[str, dict[str, Any]]
) -> None:
    result = saves[name]
    assert result["failures"] == [], "\n".join(result["failures"])


def test_saves_cover_what_the_issue_asks_for(saves: dict[str, dict[str, Any]]) -> None:
    stages = {s.case[1] for s in SAVES}
    dtypes = {s.case.split("-")[1] for s in SAVES}
    assert stages == {"1", "2", "3"}
    assert dtypes == {"fp32", "fp16", "bf16"}
    assert {s.mode for s in SAVES} == {"sync", "async"}
    assert any("bf16opt" in s.case for s in SAVES)
    assert any("sg12" in s.case for s in SAVES)
    assert any("ftb" in s.case for s in SAVES)
    # straddling shards moved between ranks in at least one save, and async copied to host
    assert any(r["exchange_rounds"] > 0 for r in saves.values())
    assert all(saves[s.name]["host_copy_bytes"] > 0 for s in SAVES if s.mode == "async")


@pytest.mark.parametrize("index", range(len(LOADS)))
def test_live_store_loads_elsewhere(index: int, loads: dict[str, dict[str, Any]]) -> None:
    save, load = LOADS[index]
    result = loads[f"{save.name}--{load.name}"]
    assert result["failures"] == [], "\n".join(result["failures"])


def _refused(store: Path) -> None:
    with pytest.raises((IncompleteStoreError, NotAStoreError, SourceNotFoundError)):
        ucformat.open(store)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rank_killed_while_writing_leaves_no_complete_store(mode: str, work: Path) -> None:
    save = LiveSave("z2-bf16-dsadam-simple-ws2", mode)
    status, _ = run_fault(save, "kill", work / "kill")
    assert status not in (0, None)  # the launch failed (torchrun tore the job down)
    store = work / "kill" / save.name / "live.ucf"
    assert (staging_path(store) / "zarr.json").exists()  # the save had started writing, staged
    assert not store.exists()  # nothing at the destination until the commit
    with pytest.raises((NotAStoreError, SourceNotFoundError)):
        ucformat.open(store)
    result = CliRunner().invoke(app, ["verify", str(store)])
    assert result.exit_code == 2


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_failing_write_is_one_typed_error_on_every_rank(mode: str, work: Path) -> None:
    save = LiveSave("z1-fp32-dsadam-simple-ws2", mode)
    status, result = run_fault(save, "fsize", work / "fsize")
    assert status == 0
    assert result is not None
    outcomes = result["outcomes"]
    assert [o["raised"] for o in outcomes] == ["CollectiveError"] * 2
    assert {o["failed_rank"] for o in outcomes} == {1}
    assert len({o["message"] for o in outcomes}) == 1  # the same error everywhere
    assert "File too large" in outcomes[0]["message"]
    _refused(work / "fsize" / save.name / "live.ucf")


def test_a_rank_that_does_not_answer_is_named_within_the_timeout(work: Path) -> None:
    save = LiveSave("z1-fp32-dsadam-simple-ws2", "sync")
    status, result = run_fault(save, "hang", work / "hang")
    assert status == 0
    assert result is not None
    outcomes = result["outcomes"]
    assert [o["raised"] for o in outcomes] == ["CollectiveError"] * 2
    assert [o["missing"] for o in outcomes] == [[1], [1]]  # decided once, for both
    assert len({o["message"] for o in outcomes}) == 1
    assert "rank 1 of 2 did not answer within 4 s" in outcomes[0]["message"]
    assert "\n" not in outcomes[0]["message"]
    _refused(work / "hang" / save.name / "live.ucf")


def test_save_and_save_async_to_s3_equal_a_local_save(s3: Any, work: Path) -> None:
    """ZeRO-3 at 2 ranks: ``save`` and ``save_async`` to the local S3 server write the objects
    a local ``save`` writes, byte for byte."""
    from tests.conftest import S3_BUCKET

    save = LiveSave("z3-bf16-dsadam-ftb-ws2", "sync")
    status, result = run_fault(save, "s3", work / "s3", url=f"s3://{S3_BUCKET}/live")
    assert status == 0
    assert result is not None
    assert result["failures"] == [], "\n".join(result["failures"])
    assert all(o["blocked"] <= o["seconds"] for o in result["outcomes"])
