"""torchrun worker (world size 1): a real DeepSpeed checkpoint holding every dtype of the format.

Used by :mod:`tests.conformance.make_golden` for the ``dtype-zoo`` golden store::

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 1 tests/conformance/_dtype_zoo_worker.py OUT

A small fp32 model under ZeRO-2 with torch Adam, with persistent buffers of every other dtype
(float64, float16, bfloat16, int64, int32, int16, int8, uint8, bool; fp32 training leaves
buffers in their dtype), trained 2 steps, saved with ``engine.save_checkpoint(OUT/ckpt)``; the
truth (fp32 master weights, Adam states and steps read with DeepSpeed's own API, buffers from
the live module) goes to ``OUT/truth.pt`` in the layout of the fixture grid's truth files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

BUFFERS = {
    "f64": (torch.float64, (2, 3)),
    "f16": (torch.float16, (5,)),
    "bf16": (torch.bfloat16, (3, 2)),
    "i64": (torch.int64, ()),
    "i32": (torch.int32, (3,)),
    "i16": (torch.int16, (2, 2)),
    "i8": (torch.int8, (5,)),
    "u8": (torch.uint8, (4,)),
    "flags": (torch.bool, (3,)),
}


class DtypeZoo(nn.Module):
    """``fc: Linear(6, 4)`` and ``head: Linear(4, 3)``, plus one buffer per dtype in ``stats``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.head = nn.Linear(4, 3)
        self.stats = nn.Module()
        generator = torch.Generator().manual_seed(7)
        for name, (dtype, shape) in BUFFERS.items():
            if dtype.is_floating_point:
                value = torch.randn(shape, generator=generator).to(dtype)
            elif dtype == torch.bool:
                value = torch.randint(0, 2, shape, generator=generator).bool()
            else:
                info = torch.iinfo(dtype)
                low, high = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
                value = torch.randint(low, high, shape, generator=generator).to(dtype)
            self.stats.register_buffer(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits; the buffers are state only."""
        return self.head(torch.relu(self.fc(x)))


def main(out: Path) -> None:
    """Train, save and dump the truth into ``out``."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.manual_seed(0)
    model = DtypeZoo()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    for _ in range(2):
        loss = engine(torch.randn(2, 6)).square().mean()
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(str(out / "ckpt"))
    named = list(engine.module.named_parameters())
    state = engine.optimizer.optimizer.state
    steps = [s["step"] for s in state.values() if "step" in s]
    truth = {
        "fp32": {n: safe_get_full_fp32_param(p).clone() for n, p in named},
        "optim": {
            n: {k: safe_get_full_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")}
            for n, p in named
        },
        "step": {n: steps[0].clone() for n, _ in named},  # one flat group: one step
        "frozen": {},
        "buffers": {n: b.clone() for n, b in engine.module.named_buffers()},
        "shared_params": {},
        "param_groups": [{"param_names": [n for n, _ in named]}],
    }
    torch.save(truth, out / "truth.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
