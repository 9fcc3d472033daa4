"""DeepSpeed -> convert -> export -> DeepSpeed's own loader at another world size -> truth.

Each case of ``tests/fixtures/export_cases.py`` runs in a torchrun launch (CPU, gloo), batched
by target world size: a fresh engine (different seed) for the target stage and world size loads
the export with a stock ``engine.load_checkpoint(folder)`` (``load_universal`` for universal
exports), following the ``latest`` / ``latest_universal`` pointer, with ucformat unloaded and
its import blocked. DeepSpeed's own APIs then gather fp32 master weights, every optimizer state,
step, hyper-parameters, module state dict, scheduler, loss scaler and counters from the new
engine, which must equal the saved engine's exactly; the client state comes back; the forward
loss on a fixed batch equals the saved engine's; 3 more steps train (bit-identical to the
never-stopped run when the layout is the source's own).

DeepSpeed 0.19.8's universal loader skips frozen parameters and buffers (left out of those
comparisons) and copies param group 0's hyper-parameters into every group at ZeRO-3: the case
marked with ``expect`` must fail with exactly that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.export_cases import EXPORTS

pytestmark = pytest.mark.deepspeed


@pytest.fixture(scope="module")
def ds_exports(ds_grid: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Results of every export case, loaded by DeepSpeed once per module (two launches)."""
    from tests.fixtures.run_exports import run_exports

    return run_exports(EXPORTS, ds_grid, tmp_path_factory.mktemp("exports"))


@pytest.mark.parametrize("name", [case.name for case in EXPORTS if not case.expect])
def test_deepspeed_loads_the_export_exactly(name: str, ds_exports: dict[str, Any]) -> None:
    failures = ds_exports[name]["failures"]
    assert failures == [], "\n".join(failures)


@pytest.mark.parametrize("name", [case.name for case in EXPORTS if case.expect])
def test_deepspeed_universal_loader_bug_is_the_only_difference(
    name: str, ds_exports: dict[str, Any]
) -> None:
    result = ds_exports[name]
    expect = result["export"]["expect"]
    assert result["failures"], "DeepSpeed's known bug did not show; update docs/exports.md"
    assert all(any(f.startswith(e) for e in expect) for f in result["failures"]), result


def test_cases_cover_what_the_issue_asks_for() -> None:
    from tests.fixtures.ds_cases import by_name

    cases = by_name()
    native = [c for c in EXPORTS if c.kind == "native"]
    universal = [c for c in EXPORTS if c.kind == "universal"]
    for group in (native, universal):
        sources = [cases[c.source] for c in group]
        assert {s.stage for s in sources} == {1, 2, 3}
        assert {c.stage for c in group} == {1, 2, 3}
        assert {s.dtype for s in sources} >= {"fp32", "bf16"}
        assert {s.optimizer for s in sources} == {"ds_adam", "torch_adam"}
        assert any(s.model == "multi" for s in sources) and any(s.model == "ftb" for s in sources)
        assert any(c.world_size != cases[c.source].world_size for c in group)
    assert {cases[c.source].dtype for c in native} == {"fp32", "fp16", "bf16"}
    assert any(cases[c.source].bf16_optimizer for c in native)
    assert any(c.same_layout for c in native)
