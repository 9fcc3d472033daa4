"""``ucformat.deepspeed.load`` of converted PipelineModule checkpoints into engines at another
pp and dp, and into a plain (non-pipeline) engine of the same network: every rank's state equals
the saved one, and equals DeepSpeed's own universal load where DeepSpeed can convert the source
(ZeRO-1), or its own ``load_checkpoint`` where it can load the source as it is (ZeRO-0 at another
dp), next losses included (tests/fixtures/_pp_load_worker.py)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest

import ucformat
from tests.conftest import deepspeed_available
from tests.fixtures.pp_cases import by_name

pytestmark = pytest.mark.deepspeed

#: (job name, source case, target pp (0: plain engine), target dp, with DeepSpeed's oracle).
#: The plain engine comes first in its launch: after a PipelineEngine with pp > 1, DeepSpeed
#: keeps process-global pipeline state that a later plain ``deepspeed.initialize`` trips over
#: (``'NoneType' object has no attribute 'get_model_parallel_rank'``).
LOADS: tuple[tuple[str, str, int, int, bool], ...] = (
    ("bf16-pp2dp1-to-plain-dp2", "pp2dp1-z1-bf16", 0, 2, True),
    ("fp16-pp2dp2-to-plain-dp2", "pp2dp2-z1-fp16", 0, 2, True),
    ("fp16-tied-pp2dp1-to-pp1dp2", "pp2dp1-z1-fp16-tied", 1, 2, True),
    ("fp16-pp2dp2-to-pp2dp1", "pp2dp2-z1-fp16", 2, 1, True),
    ("fp16-pp2dp2-to-pp1dp2", "pp2dp2-z1-fp16", 1, 2, True),
    ("fp16-tied-pp2dp1-to-pp4dp1", "pp2dp1-z1-fp16-tied", 4, 1, True),
    ("tied-pp2dp1-to-pp1dp2", "pp2dp1-z1-fp32-tied", 1, 2, True),
    ("tied-pp1dp2-to-pp2dp1", "pp1dp2-z1-fp32-tied", 2, 1, True),
    ("fp32-pp2dp2-to-pp1dp4", "pp2dp2-z1-fp32", 1, 4, True),
    ("tied-pp2dp1-to-pp2dp2", "pp2dp1-z1-fp32-tied", 2, 2, True),
    ("bf16-z0-pp2dp2-to-pp1dp4", "pp2dp2-z0-bf16", 1, 4, False),
    ("tied-pp2dp1-to-pp4dp1", "pp2dp1-z1-fp32-tied", 4, 1, True),
    ("fp32-pp2dp2-to-pp4dp1", "pp2dp2-z1-fp32", 4, 1, True),
    ("tied-pp4dp1-to-pp2dp2", "pp4dp1-z1-fp32-tied", 2, 2, False),  # ds_to_universal fails
    # ZeRO-0 (the optimizer by position): DeepSpeed's own load_checkpoint of the checkpoint
    # itself is the oracle where it can make the change (same pp, any dp)
    ("fp32-z0-tied-pp2dp1-to-pp2dp2", "pp2dp1-z0-fp32-tied", 2, 2, True),
    ("fp16-z0-tied-pp2dp1-to-pp1dp2", "pp2dp1-z0-fp16-tied", 1, 2, False),
)
#: Jobs whose oracle is DeepSpeed's own ``load_checkpoint`` (ZeRO-0: no universal conversion).
NATIVE = {"fp32-z0-tied-pp2dp1-to-pp2dp2"}


@pytest.fixture(scope="module")
def load_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed")
    from tests.fixtures.pp_cases import generate_pipeline, run_pipeline_jobs, to_universal

    cases = generate_pipeline()
    work = tmp_path_factory.mktemp("pipeline-loads")
    sources = sorted({source for _, source, *_ in LOADS})
    stores = {s: work / "stores" / s for s in sources}
    for source, store in stores.items():
        ucformat.convert(cases[source] / "ckpt", store)
    universal = to_universal(
        {s: cases[s] for name, s, _, _, oracle in LOADS if oracle and name not in NATIVE}
    )
    jobs = [
        {
            "kind": "load", "name": name, "case": asdict(by_name(source)),
            "dir": str(cases[source]), "store": str(stores[source]),
            "universal": str(universal[source]) if oracle and name not in NATIVE else None,
            "native": name in NATIVE,
            "target": {"pp": max(pp, 1), "dp": dp, "plain": pp == 0},
            "world_size": max(pp, 1) * dp,
        }
        for name, source, pp, dp, oracle in LOADS
    ]  # fmt: skip
    return run_pipeline_jobs(jobs, work)


@pytest.mark.parametrize("name", [load[0] for load in LOADS])
def test_pipeline_store_loads_at_another_layout(
    name: str, load_results: dict[str, dict[str, Any]]
) -> None:
    result = load_results[name]
    assert result["failures"] == []
    assert len(result["losses"]) == 2
    _, source, pp, dp, oracle = next(load for load in LOADS if load[0] == name)
    if oracle:
        assert result["oracle_losses"] == result["losses"]
    if pp and dp == by_name(source).dp:  # same batches as the uninterrupted run
        assert result["uninterrupted"] == result["losses"]
    reads = result["bytes_read"]
    assert len(reads) == max(pp, 1) * dp and all(r > 0 for r in reads)
    if pp > 1:  # the first and last stages read disjoint layers: different amounts here
        assert reads[0] != reads[-1]
