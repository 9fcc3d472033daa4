"""Find the files of a DeepSpeed ZeRO checkpoint and check that the set is complete and coherent.

A DeepSpeed checkpoint *tag folder* holds (see docs/format.md and the ZeRO reference):

* ZeRO-1/2: ``mp_rank_00_model_states.pt`` and one
  ``[bf16_]zero_pp_rank_{dp}_mp_rank_00_optim_states.pt`` per data-parallel rank;
* ZeRO-3: one ``zero_pp_rank_{dp}_mp_rank_00_model_states.pt`` and one optim file per rank;
* ZeRO-0 (no ZeRO): ``mp_rank_00_model_states.pt`` alone, the optimizer saved in it by position.

The *run folder* above it holds a ``latest`` file naming the tag. This module only looks at
names and sizes; it opens nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ucformat.errors import (
    LayoutMismatchError,
    NotACheckpointError,
    SourceNotFoundError,
    UnsupportedCheckpointError,
)
from ucformat.sources.deepspeed.experts import ExpertFiles, find_expert_files

__all__ = [
    "BF16_PREFIX",
    "LATEST_FILE",
    "ZeroFiles",
    "find_zero_files",
    "locate_tag_folder",
    "model_states_file",
    "optim_states_file",
    "tensor_parallel_degree",
]

#: The file of a run folder that names its latest tag.
LATEST_FILE = "latest"
#: The name prefix of the optimizer-states files a bf16 run writes (fp16: ``fp16_``).
BF16_PREFIX = "bf16_"


def model_states_file(rank: int | None = None, mp: int = 0) -> str:
    """The model-states file name: ZeRO-1/2's one file (``rank`` None), else ZeRO-3's file of
    data-parallel ``rank``; ``mp`` is the model-parallel (tensor-parallel) rank."""
    if rank is None:
        return f"mp_rank_{mp:02d}_model_states.pt"
    return f"zero_pp_rank_{rank}_mp_rank_{mp:02d}_model_states.pt"


def optim_states_file(rank: int, prefix: str = "", mp: int = 0) -> str:
    """The optimizer-states file name of data-parallel ``rank`` (``prefix``: ``bf16_``, ...)."""
    return f"{prefix}zero_pp_rank_{rank}_mp_rank_{mp:02d}_optim_states.pt"


def tensor_parallel_degree(folder: Path) -> int:
    """Model-parallel ranks named by the folder's model-states files (1: none beyond rank 0)."""
    ranks = {
        int(m["mp"])
        for p in folder.iterdir()
        if (m := _MODEL_Z12.match(p.name) or _MODEL_Z3.match(p.name))
    }
    return max(ranks, default=0) + 1


_OPTIM = re.compile(
    r"^(?P<prefix>bf16_|fp16_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$"
)
_MODEL_Z3 = re.compile(r"^zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")
_MODEL_Z12 = re.compile(r"^mp_rank_(?P<mp>\d+)_model_states\.pt$")
_PIPELINE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$|^layer_\d+-model_states\.pt$")


@dataclass(frozen=True)
class ZeroFiles:
    """The shard files of one checkpoint tag, ordered by data-parallel rank."""

    folder: Path
    tag: str
    #: ZeRO-0/1/2: one file; ZeRO-3: one per rank.
    model_files: tuple[Path, ...]
    #: One per data-parallel rank; none at ZeRO-0 (the model states hold the optimizer).
    optim_files: tuple[Path, ...]
    per_rank_model_files: bool
    #: Native MoE expert files (:mod:`ucformat.sources.deepspeed.experts`); None without MoE.
    experts: ExpertFiles | None = None

    @property
    def world_size(self) -> int:
        """Number of data-parallel ranks, from the file names."""
        return len(self.optim_files)


def locate_tag_folder(src: Path, tag: str | None = None) -> tuple[Path, str]:
    """Resolve ``src`` (a tag folder, or a run folder with a ``latest`` file) to its tag folder.

    Raises:
        SourceNotFoundError: ``src`` or the tag folder does not exist.
        NotACheckpointError: ``src`` is a run folder without ``latest`` and no ``tag`` was given.
    """
    if not src.exists():
        raise SourceNotFoundError(f"{src}: no such file or directory.")
    if not src.is_dir():
        raise NotACheckpointError(
            f"{src}: is a file; expected a DeepSpeed checkpoint folder (the tag folder holding "
            "*_model_states.pt, or the run folder holding 'latest')."
        )
    if tag is not None:
        folder = src / tag
        if not folder.is_dir():
            tags = sorted(p.name for p in src.iterdir() if p.is_dir())
            raise SourceNotFoundError(
                f"{src}: has no tag folder '{tag}'; tags present: {', '.join(tags) or 'none'}."
            )
        return folder, tag
    if any(_is_model_file(p.name) for p in src.iterdir()):
        return src, src.name
    latest = src / LATEST_FILE
    if latest.is_file():
        name = latest.read_text().strip()
        folder = src / name
        if not folder.is_dir():
            raise SourceNotFoundError(
                f"{latest}: names tag '{name}', but {folder} does not exist; pass --tag."
            )
        return folder, name
    raise NotACheckpointError(
        f"{src}: no DeepSpeed model-states file ({model_states_file()} or "
        f"{model_states_file(0)}) and no '{LATEST_FILE}' file; expected a DeepSpeed "
        "ZeRO checkpoint tag folder or the run folder above it."
    )


def _is_model_file(name: str) -> bool:
    return bool(_MODEL_Z12.match(name) or _MODEL_Z3.match(name))


def find_zero_files(folder: Path, tag: str, mp_rank: int | None = None) -> ZeroFiles:
    """List and check the shard files in a tag folder (of model-parallel rank ``mp_rank``;
    None: the folder must hold rank 0's only).

    Raises:
        NotACheckpointError: no model-states file.
        UnsupportedCheckpointError: tensor/pipeline/expert parallel files.
        SourceNotFoundError: a rank's file is missing.
        LayoutMismatchError: files from different runs are mixed.
    """
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    experts = find_expert_files(folder, names)
    if experts is not None:
        names = list(experts.other)
    if any(_PIPELINE.match(n) for n in names):
        raise UnsupportedCheckpointError(
            f"{folder}: pipeline-parallel layer files (layer_*-model_states.pt) found; ucformat "
            "converts data-parallel ZeRO checkpoints only."
        )
    model_z12 = [n for n in names if (m := _MODEL_Z12.match(n)) and _wanted(m["mp"], mp_rank)]
    model_z3 = {
        int(m["dp"]): n for n in names if (m := _MODEL_Z3.match(n)) and _wanted(m["mp"], mp_rank)
    }
    optim: dict[int, str] = {}
    prefixes: set[str] = set()
    for name in names:
        match = _OPTIM.match(name)
        if match is None:
            continue
        if int(match["mp"]) != (mp_rank or 0):
            if mp_rank is None:
                raise _tensor_parallel(folder, name)
            continue
        dp = int(match["dp"])
        if dp in optim:
            raise LayoutMismatchError(
                f"{folder}: two optimizer shards for rank {dp} ({optim[dp]} and {name}); files "
                "from different runs are mixed."
            )
        optim[dp] = name
        prefixes.add(match["prefix"] or "")
    for name in [*model_z12, *model_z3.values()]:
        mp = _MODEL_Z12.match(name) or _MODEL_Z3.match(name)
        if mp is not None and int(mp["mp"]) != 0 and mp_rank is None:
            raise _tensor_parallel(folder, name)
    if model_z12 and model_z3:
        raise LayoutMismatchError(
            f"{folder}: holds both ZeRO-1/2 ({model_z12[0]}) and ZeRO-3 "
            f"({model_z3[min(model_z3)]}) model files; files from different runs are mixed."
        )
    if not model_z12 and not model_z3:
        raise NotACheckpointError(
            f"{folder}: no DeepSpeed model-states file ({model_states_file()} or "
            f"{model_states_file(0)}); not a DeepSpeed checkpoint folder."
        )
    if not optim and experts is not None and experts.expp_optim and model_z12:
        return ZeroFiles(folder, tag, (folder / model_z12[0],), experts.expp_optim, False, experts)
    if not optim and model_z12:  # ZeRO-0: the optimizer by position, in the model states
        return ZeroFiles(folder, tag, (folder / model_z12[0],), (), False, experts)
    if not optim:
        raise UnsupportedCheckpointError(
            f"{folder}: has ZeRO-3 model states but no *_optim_states.pt shards; the checkpoint "
            "is incomplete."
        )
    if len(prefixes) > 1:
        raise LayoutMismatchError(
            f"{folder}: optimizer shards with different name prefixes ({sorted(prefixes)}); files "
            "from different runs are mixed."
        )
    world_size = max(optim) + 1
    prefix = prefixes.pop()
    for rank in range(world_size):
        if rank not in optim:
            raise SourceNotFoundError(
                f"{folder / optim_states_file(rank, prefix, mp_rank or 0)}: missing; "
                f"the folder has optimizer shards up to rank {world_size - 1}, so every rank "
                f"0..{world_size - 1} must be present."
            )
    if model_z3:
        for rank in range(world_size):
            if rank not in model_z3:
                raise SourceNotFoundError(
                    f"{folder / model_states_file(rank, mp_rank or 0)}: missing; "
                    f"ZeRO-3 writes one model-states file per rank (found {world_size} optimizer "
                    "shards)."
                )
        extra = sorted(r for r in model_z3 if r >= world_size)
        if extra:
            raise LayoutMismatchError(
                f"{folder}: model-states files for ranks {extra} but optimizer shards only for "
                f"ranks 0..{world_size - 1}; files from different runs are mixed."
            )
    model_files = (
        tuple(folder / model_z3[r] for r in range(world_size))
        if model_z3
        else (folder / model_z12[0],)
    )
    return ZeroFiles(
        folder=folder,
        tag=tag,
        model_files=model_files,
        optim_files=tuple(folder / optim[r] for r in range(world_size)),
        per_rank_model_files=bool(model_z3),
        experts=experts,
    )


def _wanted(mp: str, mp_rank: int | None) -> bool:
    return mp_rank is None or int(mp) == mp_rank


def _tensor_parallel(folder: Path, name: str) -> UnsupportedCheckpointError:
    return UnsupportedCheckpointError(
        f"{folder / name}: tensor-parallel (mp_rank > 0) shards found; ucformat converts "
        "data-parallel ZeRO checkpoints only."
    )
