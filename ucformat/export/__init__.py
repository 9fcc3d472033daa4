"""Exports: write a ucformat store in another framework's own format.

* :func:`export_safetensors`: consolidated weights, Hugging Face sharded safetensors layout;
* :func:`export_deepspeed_universal`: DeepSpeed's universal checkpoint folder
  (``load_universal``), loadable at any world size;
* :func:`export_deepspeed`: a native ZeRO-1/2/3 checkpoint for a new world size and stage that
  a stock ``engine.load_checkpoint`` loads;
* :func:`export_dcp`: a PyTorch Distributed Checkpoint that stock ``dcp.load`` reads into an
  FSDP2 model at any world size;
* :func:`export_accelerate`: an Accelerate FSDP2 ``save_state`` folder that stock
  ``accelerator.load_state`` resumes at any world size;
* :func:`export_megatron`: a Megatron-Core ``torch_dist`` checkpoint that Megatron-LM and stock
  ``dist_checkpointing.load`` resume at a new TP x PP x EP, with the optimizer of either kind.

Each target module plans from the manifest alone (so ``dry_run`` reads no tensor), then streams
the arrays it needs through :class:`~ucformat.read.checkpoint.UniversalCheckpoint`. DeepSpeed is
imported only when a DeepSpeed export actually writes files.
"""

from __future__ import annotations

from ucformat.export.accelerate import export_accelerate
from ucformat.export.common import ExportHooks, ExportResult
from ucformat.export.dcp import export_dcp, plan_dcp
from ucformat.export.deepspeed_native import export_deepspeed, plan_deepspeed
from ucformat.export.deepspeed_universal import (
    export_deepspeed_universal,
    plan_deepspeed_universal,
)
from ucformat.export.megatron import export_megatron, plan_megatron
from ucformat.export.safetensors import export_safetensors, plan_safetensors

__all__ = [
    "ExportHooks",
    "ExportResult",
    "export_accelerate",
    "export_dcp",
    "export_deepspeed",
    "export_deepspeed_universal",
    "export_megatron",
    "export_safetensors",
    "plan_dcp",
    "plan_deepspeed",
    "plan_deepspeed_universal",
    "plan_megatron",
    "plan_safetensors",
]
