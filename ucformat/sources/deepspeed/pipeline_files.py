"""The file names of a DeepSpeed pipeline checkpoint, and its ZeRO optimizer shards (names only).

Shared by the pipeline reader (``sources/deepspeed/pipeline.py``) and its tensor-parallel
variant (``sources/deepspeed/pipeline_tp.py``): one ``mp_rank_XX_model_states.pt`` per model
rank, one ``[bf16_|fp16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt`` per model rank and
data-parallel rank, and the layer files (``layer_LL-model_states.pt``, or
``layer_LL-model_TT-model_states.pt`` with tensor parallelism).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path

from ucformat.errors import LayoutMismatchError, SourceNotFoundError, UnsupportedCheckpointError

__all__ = ["LAYER_FILE", "LAYER_TP_FILE", "MODEL_FILE", "OPTIM_FILE", "optimizer_shards"]

MODEL_FILE = re.compile(r"^mp_rank_(?P<mp>\d+)_model_states\.pt$")
OPTIM_FILE = re.compile(
    r"^(?P<prefix>bf16_|fp16_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$"
)
LAYER_FILE = re.compile(r"^layer_(?P<layer>\d+)-model_states\.pt$")
LAYER_TP_FILE = re.compile(r"^layer_(?P<layer>\d+)-model_(?P<tp>\d+)-model_states\.pt$")


def optimizer_shards(
    folder: Path,
    names: Sequence[str],
    ranks: int,
    *,
    none_found: str,
    layout: Callable[[int], str],
) -> tuple[dict[int, dict[int, str]], int]:
    """The optimizer shards among ``names``: ``shards[mp][dp]`` (a file name) and the
    data-parallel size, checked complete for model ranks ``0 .. ranks - 1`` (and any higher one
    a shard names).

    ``none_found`` ends the message when there is no shard at all; ``layout(dp)`` says, in the
    message of a missing shard, which shards the layout has.

    Raises:
        UnsupportedCheckpointError: no optimizer shard.
        LayoutMismatchError: shards with different name prefixes (files of different runs).
        SourceNotFoundError: a (model rank, data-parallel rank)'s shard is missing.
    """
    shards: dict[int, dict[int, str]] = {}
    prefixes: set[str] = set()
    for name in names:
        if (match := OPTIM_FILE.match(name)) is not None:
            shards.setdefault(int(match["mp"]), {})[int(match["dp"])] = name
            prefixes.add(match["prefix"] or "")
    if not shards:
        raise UnsupportedCheckpointError(f"{folder}: {none_found}")
    if len(prefixes) > 1:
        raise LayoutMismatchError(
            f"{folder}: optimizer shards with different name prefixes ({sorted(prefixes)}); files "
            "from different runs are mixed."
        )
    prefix = prefixes.pop()
    dp = max(max(found) for found in shards.values()) + 1
    for mp in range(max(ranks, max(shards) + 1)):
        for rank in range(dp):
            if rank not in shards.get(mp, {}):
                missing = f"{prefix}zero_pp_rank_{rank}_mp_rank_{mp:02d}_optim_states.pt"
                raise SourceNotFoundError(f"{folder / missing}: missing; {layout(dp)}")
    return shards, dp
