"""The GPU path: saves and loads on CUDA (marked ``gpu``; skipped where CUDA is not available).

One torchrun launch of ``tests/fixtures/_gpu_worker.py`` on one GPU (W = 1, NCCL) runs:

* ``ucformat.deepspeed.save`` / ``save_async`` / ``load`` of a CUDA engine at ZeRO-1 and
  ZeRO-3 (bf16, torch Adam): each store equal, object for object, to ``ucformat convert`` of
  ``save_checkpoint``'s files; the device tensors staged through pinned memory
  (``SaveReport.pinned_bytes``); the load filling the engine's partitions through the two
  pinned windows of ``read.staging`` and never through a full-size host copy; the loaded
  engine's own save equal to the first store;
* ``ucformat.torch.save`` / ``save_async`` / ``load`` of an FSDP2 model on a CUDA mesh: pinned
  copies, every parameter equal after the load, the reloaded model's save equal to the first.

Seconds of each, beside ``save_checkpoint`` / ``load_checkpoint`` and ``dcp.save`` /
``dcp.load`` on the same card, are in the results (docs/benchmarks.md records them when a GPU
was lent). Not run on a GPU yet (docs/benchmarks.md, "GPU"); the staging logic itself runs on
the CPU in tests/integration/test_device_staging.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fixtures.ds_cases import by_name, case_to_dict
from tests.launch import launch_env, run_in_group, torchrun_command

pytestmark = [pytest.mark.gpu, pytest.mark.deepspeed]

WORKER = Path(__file__).resolve().parents[1] / "fixtures" / "_gpu_worker.py"
CASES = ("z1-bf16-tadam-simple-ws1", "z3-bf16-tadam-simple-ws1")


def run_gpu_jobs(work: Path, device: str = "cuda") -> dict[str, dict]:
    """One launch of every GPU job on ``device``; each job's result by name."""
    jobs = [
        {"kind": "deepspeed", "case": case_to_dict(by_name()[name]), "dir": str(work / name),
         "result": str(work / f"{name}.json")}
        for name in CASES
    ]  # fmt: skip
    jobs.append({"kind": "fsdp2", "model": "multi", "dir": str(work / "fsdp2"),
                 "result": str(work / "fsdp2.json")})  # fmt: skip
    (work / "jobs.json").write_text(json.dumps(jobs))
    command = torchrun_command(1, [str(WORKER), "--jobs", str(work / "jobs.json"), "--device",
                                   device])  # fmt: skip
    env = launch_env({"DS_ACCELERATOR": device})
    env.pop("OMP_NUM_THREADS", None)
    done = run_in_group(command, timeout_s=900, log_path=work / "gpu.log", env=env)
    assert done.returncode == 0, (work / "gpu.log").read_text()[-4000:]
    return {Path(j["result"]).stem: json.loads(Path(j["result"]).read_text()) for j in jobs}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return run_gpu_jobs(tmp_path_factory.mktemp("gpu"))


@pytest.mark.parametrize("job", [*CASES, "fsdp2"])
def test_saves_and_loads_on_cuda(job: str, results: dict[str, dict]) -> None:
    result = results[job]
    assert result["failures"] == [], result["failures"]
    assert result["device"] != "cpu (dry run)"
    print(job, result["device"], result["seconds"])  # the timings, beside the stock tools'
