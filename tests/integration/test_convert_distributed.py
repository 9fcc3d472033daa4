"""``torchrun -m ucformat_cli convert``: every process writes a share, rank 0 commits.

Two processes must produce exactly the store a single-process convert makes (every object,
manifest included: same source, same plan); a process whose writes fail (``RLIMIT_FSIZE``:
EFBIG, a real OS error) must fail every process with the same one-line error and exit code 2,
and leave no committed store.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import ucformat
from tests.launch import REPO_ROOT, run_in_group, torchrun_command
from ucformat.errors import IncompleteStoreError, NotAStoreError, SourceNotFoundError

pytestmark = pytest.mark.deepspeed  # needs torchrun (torch.distributed), not DeepSpeed itself

SOURCE = REPO_ROOT / "tests" / "fixtures" / "data" / "z3-bf16-dsadam-ftb-ws4" / "ckpt"
SMALL = ["--chunk-kib", "1", "--shard-mib", "1"]


def _torchrun(
    args: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    command = torchrun_command(
        2, [str(REPO_ROOT / "tests" / "fixtures" / "_limited_cli.py"), *args]
    )
    done = run_in_group(command, timeout_s=600, env=env, capture=True)
    assert done.returncode is not None, f"distributed convert timed out: {done.stdout[-2000:]}"
    return done


def _objects(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_two_processes_write_the_single_process_store(tmp_path: Path) -> None:
    single, spread = tmp_path / "single.ucf", tmp_path / "spread.ucf"
    ucformat.convert(SOURCE, single, chunk_bytes=1024, shard_bytes=1024 * 1024)
    done = _torchrun(["convert", "--distributed", str(SOURCE), str(spread), *SMALL])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("wrote ") == 1  # rank 0 reports
    assert _objects(spread) == _objects(single)
    assert ucformat.verify(spread, against=SOURCE).ok


def test_one_failing_process_fails_all_and_commits_nothing(tmp_path: Path) -> None:
    spread = tmp_path / "spread.ucf"
    done = _torchrun(
        ["convert", "--distributed", str(SOURCE), str(spread), *SMALL], {"UCF_TEST_FSIZE_RANK": "1"}
    )
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    # One line per process that got to print it before torchrun tore the job down, the same
    # on each, naming the process that failed; no traceback from ucformat's own code.
    assert errors, done.stderr[-3000:]
    assert len(set(errors)) == 1
    assert "failed on rank 1 of 2" in errors[0]
    assert "File too large" in errors[0]
    assert "exitcode  : 2" in done.stderr  # the CLI's user-error exit code
    assert f'File "{REPO_ROOT / "ucformat"}' not in done.stderr
    with pytest.raises((IncompleteStoreError, NotAStoreError, SourceNotFoundError)):
        ucformat.open(spread)


def _dcp_with_own_keys(folder: Path) -> None:
    """A real ``dcp.save`` of a model and its AdamW state under the keys 'net' and 'opt' (none
    of the layouts the reader knows by default: they must be named)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    state = {
        "net": get_model_state_dict(model),
        "opt": get_optimizer_state_dict(model, optimizer, options=flat),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving as a single process"
        dcp.save(state, checkpoint_id=folder)


def test_every_option_reaches_the_distributed_convert(tmp_path: Path) -> None:
    """--model-key, --optimizer-key and --no-check-source mean under --distributed what they
    mean in one process (one ConvertSettings, one reader call), and the summary names the
    source's kind; three commands in one torchrun launch."""
    from tests.integration.test_source_crc import damaged_copy

    dcp_source = tmp_path / "dcp"
    _dcp_with_own_keys(dcp_source)
    damaged, _ = damaged_copy(tmp_path)
    keys, unchecked, checked = (tmp_path / f"{name}.ucf" for name in ("keys", "no-crc", "crc"))
    spec = tmp_path / "jobs.json"
    spec.write_text(
        json.dumps(
            {
                "commands": [
                    ["convert", "--distributed", str(dcp_source), str(keys), "-q",
                     "--model-key", "net", "--optimizer-key", "opt"],
                    ["convert", "--distributed", str(damaged), str(unchecked), "-q",
                     "--no-check-source"],
                    ["convert", "--distributed", str(damaged), str(checked), "-q"],
                ],
                "result": str(tmp_path / "results"),
            }
        )
    )  # fmt: skip
    worker = REPO_ROOT / "tests" / "fixtures" / "_cli_jobs_worker.py"
    done = run_in_group(torchrun_command(2, [str(worker), "--jobs", str(spec)]), timeout_s=600)
    assert done.returncode == 0, "the launch failed"
    ranks = [json.loads((tmp_path / f"results.rank{r}.json").read_text()) for r in range(2)]
    (named, no_crc, crc) = zip(*ranks, strict=True)

    assert [r["code"] for r in named] == [0, 0], named
    assert "from PyTorch DCP x1 float32" in named[0]["stdout"], named[0]
    single = tmp_path / "single-keys.ucf"
    ucformat.convert(dcp_source, single, model_key="net", optimizer_key="opt")
    assert _objects(keys) == _objects(single)

    assert [r["code"] for r in no_crc] == [0, 0], no_crc  # the damaged byte is converted
    single = tmp_path / "single-no-crc.ucf"
    ucformat.convert(damaged, single, check_source=False)
    assert _objects(unchecked) == _objects(single)

    assert [r["code"] for r in crc] == [2, 2], crc  # by default the same source is refused
    assert "fails its CRC-32" in crc[0]["stderr"], crc[0]
    with pytest.raises((IncompleteStoreError, NotAStoreError, SourceNotFoundError)):
        ucformat.open(checked)


def test_one_process_joins_and_leaves_again(tmp_path: Path) -> None:
    """Commands that each join torchrun's group and leave it again, one after another in the
    same processes (a script calling ``convert_distributed`` twice): each one's group is new,
    none meets the keys the one before left in the rendezvous store (that hung the second
    join), and every store equals the single-process convert's."""
    dsts = [tmp_path / f"again{i}.ucf" for i in range(3)]
    spec = tmp_path / "jobs.json"
    spec.write_text(
        json.dumps(
            {
                "commands": [["convert", "--distributed", str(SOURCE), str(d), "-q", *SMALL]
                             for d in dsts],
                "result": str(tmp_path / "results"),
                "own_joins": True,
            }
        )
    )  # fmt: skip
    worker = REPO_ROOT / "tests" / "fixtures" / "_cli_jobs_worker.py"
    env = {"UCFORMAT_JOIN_TIMEOUT_S": "120"}
    done = run_in_group(
        torchrun_command(2, [str(worker), "--jobs", str(spec)]), timeout_s=600, env=env
    )
    assert done.returncode == 0, "the launch failed or hung"
    ranks = [json.loads((tmp_path / f"results.rank{r}.json").read_text()) for r in range(2)]
    assert [[r["code"] for r in rank] for rank in ranks] == [[0, 0, 0], [0, 0, 0]], ranks
    single = tmp_path / "single.ucf"
    ucformat.convert(SOURCE, single, chunk_bytes=1024, shard_bytes=1024 * 1024)
    for dst in dsts:
        assert _objects(dst) == _objects(single)
