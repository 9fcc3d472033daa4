"""Pick the reader for a source path: a Megatron-Core ``torch_dist`` folder, a PyTorch DCP folder,
Hugging Face weights (safetensors) or a DeepSpeed ZeRO checkpoint."""

from __future__ import annotations

from pathlib import Path

from ucformat.errors import NotACheckpointError, UnsupportedCheckpointError
from ucformat.sources.accelerate import (
    accelerate_model_index,
    is_accelerate_folder,
    read_accelerate_state,
)
from ucformat.sources.base import SourceCheckpoint
from ucformat.sources.dcp import is_dcp_folder, read_dcp_checkpoint
from ucformat.sources.deepspeed.checkpoint import read_deepspeed_checkpoint
from ucformat.sources.deepspeed.pipeline import is_pipeline_folder, read_pipeline_checkpoint
from ucformat.sources.lightning_meta import with_lightning_meta
from ucformat.sources.megatron import is_megatron_folder, read_megatron_checkpoint
from ucformat.sources.safe_unpickle import PicklePolicy
from ucformat.sources.safetensors import is_safetensors_source, read_safetensors
from ucformat.sources.torch_checkpointing import (
    is_torch_checkpointing_folder,
    read_torch_checkpointing,
)
from ucformat.sources.unwrap import unwrap_names

__all__ = ["read_source"]


def read_source(
    src: Path,
    *,
    tag: str | None = None,
    policy: PicklePolicy | None = None,
    model_key: str | None = None,
    optimizer_key: str | None = None,
    check_crc: bool = True,
    head_dim: int | None = None,
) -> SourceCheckpoint:
    """Open ``src`` with the reader its files call for (a ``.metadata`` file means DCP; a
    ``pytorch_model_fsdp_0/`` DCP folder in it, an Accelerate FSDP2 ``save_state`` folder; a
    ``.safetensors`` file or a folder of them without DeepSpeed files, Hugging Face weights;
    ``metadata.pkl``, a torch_checkpointing folder).

    ``check_crc``: checksum DeepSpeed shard files' tensor bytes as they are read (their zip
    CRC-32; DCP items are not checked this way yet). ``head_dim``: DCP and torch_checkpointing
    folders of torchtitan's ``fuse_qkv`` (split weights, fused optimizer state) are rejoined
    with heads of this many rows (:mod:`ucformat.sources.torchtitan`). Names are the model's
    own: wrapper components (``_checkpoint_wrapped_module.``, ``_orig_mod.``,
    ``_fsdp_wrapped_module.``) are dropped (:mod:`ucformat.sources.unwrap`).

    Raises:
        UnsupportedCheckpointError: an option of one format was given for the other.
        UCFormatError: whatever the chosen reader raises.
    """
    plain = tag is None and model_key is None and optimizer_key is None and head_dim is None
    if is_megatron_folder(src) and plain:
        return read_megatron_checkpoint(src, policy=policy)  # a DCP folder with Megatron's keys
    index = accelerate_model_index(src)
    if index is not None and plain:
        return unwrap_names(read_accelerate_state(Path(src).parent, index=index, policy=policy))
    if is_torch_checkpointing_folder(src):
        if tag is not None:
            raise UnsupportedCheckpointError(
                f"{src}: is a torch_checkpointing folder; --tag applies to DeepSpeed run "
                "folders only."
            )
        return unwrap_names(
            read_torch_checkpointing(
                src,
                model_key=model_key,
                optimizer_key=optimizer_key,
                policy=policy,
                head_dim=head_dim,
            )
        )
    if is_dcp_folder(src):
        if tag is not None:
            raise UnsupportedCheckpointError(
                f"{src}: is a PyTorch Distributed Checkpoint folder; --tag applies to DeepSpeed "
                "run folders only."
            )
        ckpt = read_dcp_checkpoint(
            src, model_key=model_key, optimizer_key=optimizer_key, policy=policy, head_dim=head_dim
        )
        return unwrap_names(with_lightning_meta(ckpt, src, policy))
    if is_accelerate_folder(src):  # Accelerate FSDP2 save_state: model + optimizer DCP folders
        if not plain:
            raise UnsupportedCheckpointError(
                f"{src}: is an Accelerate save_state folder; --tag, --model-key, "
                "--optimizer-key and --head-dim do not apply (convert its DCP folders one by one "
                "to use them)."
            )
        return unwrap_names(read_accelerate_state(src, policy=policy))
    if head_dim is not None:
        raise UnsupportedCheckpointError(
            f"{src}: --head-dim applies to DCP and torch_checkpointing folders (torchtitan's "
            "fuse_qkv) only."
        )
    if is_safetensors_source(src):
        if tag is not None or model_key is not None or optimizer_key is not None:
            raise UnsupportedCheckpointError(
                f"{src}: holds Hugging Face weights (safetensors); --tag, --model-key and "
                "--optimizer-key do not apply to it."
            )
        return unwrap_names(read_safetensors(src))
    if model_key is not None or optimizer_key is not None:
        raise UnsupportedCheckpointError(
            f"{src}: has no DCP .metadata file; --model-key/--optimizer-key apply to PyTorch "
            "Distributed Checkpoint folders only."
        )
    if is_pipeline_folder(src, tag):
        return read_pipeline_checkpoint(src, tag, policy, check_crc=check_crc)
    try:
        return unwrap_names(read_deepspeed_checkpoint(src, tag, policy, check_crc=check_crc))
    except NotACheckpointError:
        if tag is None and _nothing_known(src):
            raise NotACheckpointError(_looked_for(src)) from None
        raise


def _nothing_known(src: Path) -> bool:
    """Whether the folder ``src`` holds none of the files any reader starts from (a folder of
    DeepSpeed shards without its model-states file keeps the DeepSpeed reader's message)."""
    if not src.is_dir() or (src / "latest").exists():
        return False
    return not any(path.name.endswith("_states.pt") for path in src.iterdir())


def _looked_for(src: Path) -> str:
    """The one line for a folder that is no checkpoint: what was looked for, per format."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in src.iterdir())
    found = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return (
        f"{src}: not a checkpoint ucformat reads. Looked for: DeepSpeed ZeRO (a tag folder with "
        "mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt, or a run "
        "folder with 'latest'; a Hugging Face Trainer checkpoint-N/ is one); PyTorch DCP (a "
        "'.metadata' file: dcp.save, FSDP2, torchtitan, Lightning; with 'common.pt': "
        "Megatron-Core torch_dist); Accelerate FSDP2 save_state (a 'pytorch_model_fsdp_0/' "
        f"folder). Found: {found or 'nothing (the folder is empty)'}."
    )
