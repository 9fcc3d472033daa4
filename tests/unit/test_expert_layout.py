"""Expert-parallel rank arithmetic (ucformat.layout.experts) against explicit models.

The model of DeepSpeed's groups (deepspeed/utils/groups.py, ``_create_expert_and_data_parallel``,
no tensor or pipeline parallelism): E + D puts expert-parallel groups on consecutive ranks
``[i * ep, (i + 1) * ep)`` and expert-data-parallel groups on strided ranks ``range(i, W, ep)``;
D + E (``use_data_before_expert_parallelism``) builds expert-data-parallel groups on consecutive
ranks ``[i * W/ep, (i + 1) * W/ep)`` and expert-parallel groups strided by ``W/ep``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from ucformat.errors import LayoutMismatchError
from ucformat.layout.experts import ExpertRanks, expert_id, with_expert_id


def _groups(world: int, ep: int, data_before: bool) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, expert-data-parallel groups) as DeepSpeed builds them."""
    stride = world // ep
    if data_before:
        edp = [list(range(i * stride, (i + 1) * stride)) for i in range(ep)]
        epg = [list(range(i, world, stride)) for i in range(stride)]
    else:
        edp = [list(range(i, world, ep)) for i in range(ep)]
        epg = [list(range(i * ep, (i + 1) * ep)) for i in range(stride)]
    return epg, edp


@pytest.mark.parametrize("data_before", [False, True])
@pytest.mark.parametrize(("world", "ep"), [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (8, 2), (6, 3)])
def test_ranks_match_deepspeeds_groups(world: int, ep: int, data_before: bool) -> None:
    ranks = ExpertRanks(world, ep, 12, data_before)
    epg, edp = _groups(world, ep, data_before)
    for rank in range(world):
        (mine,) = [g for g in epg if rank in g]
        (peers,) = [g for g in edp if rank in g]
        assert ranks.ep_rank(rank) == mine.index(rank)
        assert ranks.expert_dp_rank(rank) == peers.index(rank)
    assert ranks.expert_dp_size == len(edp[0])


@pytest.mark.parametrize(("world", "ep", "experts"), [(2, 2, 4), (4, 2, 4), (4, 4, 8), (6, 3, 6)])
def test_every_global_expert_is_held_by_exactly_one_ep_rank(
    world: int, ep: int, experts: int
) -> None:
    ranks = ExpertRanks(world, ep, experts)
    held: dict[int, set[int]] = {}
    for rank in range(world):
        for local in range(ranks.num_local):
            gid = ranks.global_id(ranks.ep_rank(rank), local)
            held.setdefault(gid, set()).add(ranks.ep_rank(rank))
    assert sorted(held) == list(range(experts))
    assert all(len(owners) == 1 for owners in held.values())


def test_global_names() -> None:
    ranks = ExpertRanks(4, 2, 4)
    local = "moe1.deepspeed_moe.experts.deepspeed_experts.1.up.weight"
    assert ranks.global_name(0, local) == local
    assert ranks.global_name(1, local).endswith("deepspeed_experts.3.up.weight")
    assert ranks.global_name(3, "embed.weight") == "embed.weight"
    assert expert_id(local) == ("moe1.deepspeed_moe.experts.deepspeed_experts", 1, "up.weight")
    assert expert_id("a.deepspeed_experts.x.w") is None
    assert with_expert_id("embed.weight", 3) == "embed.weight"


def test_impossible_layouts_are_refused() -> None:
    with pytest.raises(LayoutMismatchError, match="does not divide the world size 3"):
        ExpertRanks(3, 2, 4)
    with pytest.raises(LayoutMismatchError, match="does not divide the 3 experts"):
        ExpertRanks(2, 2, 3)
    with pytest.raises(LayoutMismatchError, match="outside"):
        ExpertRanks(2, 2, 4).global_id(0, 2)


def test_live_save_of_an_moe_engine_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    import ucformat
    from ucformat.errors import UCFormatError

    engine = SimpleNamespace(has_moe_layers=True)
    with pytest.raises(UCFormatError, match="live saves of MoE engines are not supported yet"):
        ucformat.deepspeed.save(engine, tmp_path / "moe.ucf")
    assert not (tmp_path / "moe.ucf").exists()
