"""Megatron-Core ``torch_dist`` checkpoints: a real GPTModel (GQA, SwiGLU) trained at TP=2 with
Megatron's DDP and distributed Adam, saved by ``dist_checkpointing.save``, against its TP=1
reload through Megatron's own ``dist_checkpointing.load`` (tests/fixtures/megatron_cases.py).

Two torchrun launches (W=2 save, W=1 reload), cached under tests/.cache/megatron.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.megatron_cases import generate_megatron, truth_path

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (the 'megatron' extra)",
)


@pytest.fixture(scope="module")
def megatron_dir() -> Path:
    return generate_megatron()


@pytest.fixture(scope="module")
def truth(megatron_dir: Path) -> dict[str, Any]:
    return torch.load(truth_path(megatron_dir), weights_only=False)


def test_fixture_tp1_reload_reproduces_the_tp2_model(megatron_dir: Path, truth: dict) -> None:
    """The oracle is Megatron's own TP=1 view of the TP=2 run: same logits, trained weights."""
    tp2 = torch.load(megatron_dir / "tp2.pt")
    assert tp2["losses"][-1] != tp2["losses"][0]
    assert truth["iteration"] == 2
    torch.testing.assert_close(truth["logits"], tp2["logits"], rtol=0, atol=1e-5)
    assert truth["optimizer"].keys() == truth["weights"].keys()
    for name, states in truth["optimizer"].items():
        assert set(states) == {"param", "exp_avg", "exp_avg_sq"}, name
        assert torch.equal(states["param"], truth["weights"][name]), name
        assert states["exp_avg_sq"].abs().sum() > 0, name
