"""Pick the reader for a source path: a Megatron-Core ``torch_dist`` folder, a PyTorch DCP folder
or a DeepSpeed ZeRO checkpoint."""

from __future__ import annotations

from pathlib import Path

from ucformat.errors import UnsupportedCheckpointError
from ucformat.sources.base import SourceCheckpoint
from ucformat.sources.dcp import is_dcp_folder, read_dcp_checkpoint
from ucformat.sources.deepspeed.checkpoint import read_deepspeed_checkpoint
from ucformat.sources.deepspeed.pipeline import is_pipeline_folder, read_pipeline_checkpoint
from ucformat.sources.megatron import is_megatron_folder, read_megatron_checkpoint
from ucformat.sources.safe_unpickle import PicklePolicy

__all__ = ["read_source"]


def read_source(
    src: Path,
    *,
    tag: str | None = None,
    policy: PicklePolicy | None = None,
    model_key: str | None = None,
    optimizer_key: str | None = None,
    check_crc: bool = True,
) -> SourceCheckpoint:
    """Open ``src`` with the reader its files call for (a ``.metadata`` file means DCP).

    ``check_crc``: checksum DeepSpeed shard files' tensor bytes as they are read (their zip
    CRC-32; DCP items are not checked this way yet).

    Raises:
        UnsupportedCheckpointError: an option of one format was given for the other.
        UCFormatError: whatever the chosen reader raises.
    """
    if is_megatron_folder(src) and model_key is None and optimizer_key is None and tag is None:
        return read_megatron_checkpoint(src, policy=policy)  # a DCP folder with Megatron's keys
    if is_dcp_folder(src):
        if tag is not None:
            raise UnsupportedCheckpointError(
                f"{src}: is a PyTorch Distributed Checkpoint folder; --tag applies to DeepSpeed "
                "run folders only."
            )
        return read_dcp_checkpoint(
            src, model_key=model_key, optimizer_key=optimizer_key, policy=policy
        )
    if model_key is not None or optimizer_key is not None:
        raise UnsupportedCheckpointError(
            f"{src}: has no DCP .metadata file; --model-key/--optimizer-key apply to PyTorch "
            "Distributed Checkpoint folders only."
        )
    if is_pipeline_folder(src, tag):
        return read_pipeline_checkpoint(src, tag, policy, check_crc=check_crc)
    return read_deepspeed_checkpoint(src, tag, policy, check_crc=check_crc)
