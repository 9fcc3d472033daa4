"""Objects and folders per store (format 3.1, docs/format.md §2.5), counted on disk.

A model of 1,024 small parameters (weights of 8 x 8 and biases of 8, as 512 tiny layers would
have), one Adam step, saved with ``ucformat.torch.save`` in one process: the store must hold at
most two objects per parameter on average and a folder per stack, where format 3.0 laid out 7
objects (three arrays' ``zarr.json``, a group's, three shards) and 4 folders per parameter. The
same live state is planned in format 3.0's layout too (the planner's ``format_version``), and
the store read back and verified.
"""

from __future__ import annotations

from pathlib import Path

import torch

import ucformat
import ucformat.torch as uctorch
from ucformat.collective import Group
from ucformat.write.plan import ConvertOptions


class _Many(torch.nn.Module):
    def __init__(self, count: int = 1024, width: int = 8) -> None:
        super().__init__()
        self.layers = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(width, width) if i % 2 else torch.randn(width))
            for i in range(count)
        )


def test_a_model_of_many_parameters_needs_at_most_two_objects_each(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Many()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sum(p.square().sum() for p in model.parameters()).backward()  # type: ignore[misc]
    optimizer.step()
    params = len(list(model.parameters()))
    assert params >= 1000
    store = tmp_path / "many.ucf"
    uctorch.save(model, optimizer, store, fsync=False)

    files = [p for p in store.rglob("*") if p.is_file()]
    folders = [p for p in store.rglob("*") if p.is_dir()]
    manifest = ucformat.open(store).manifest
    stacks = {ref.path for _, ref in manifest.arrays()}
    assert len(manifest.arrays()) == 3 * params  # fp32, exp_avg, exp_avg_sq each
    assert len(files) <= 2 * params, len(files)
    assert len(files) <= 20  # in fact 17: two stacks (one per shape), 256 arrays per shard
    assert len(folders) == 1 + len(stacks) <= 3  # stacks/ and one folder per stack
    metadata = [p for p in files if p.name.endswith(".json")]
    assert len(metadata) == 2 + 1 + len(stacks)  # root, manifest, the stacks group, stacks

    # the same live state in format 3.0's layout: one array per (parameter, state)
    from ucformat.sources.live import HostCopies
    from ucformat.torch.save import _describe
    from ucformat.write.plan import plan_convert

    one = Group(None, 0, 1)
    described = _describe(model, optimizer, None, None, str(store), one, HostCopies(False))
    old = plan_convert(described.source, ConvertOptions(format_version="3.0"))
    assert len(old.arrays) == 3 * params and len(old.units) >= 3 * params

    ckpt = ucformat.open(store)
    named = dict(model.named_parameters())
    for name in ("layers.0", "layers.511", "layers.1023"):
        assert torch.equal(ckpt.read(name, "fp32"), named[name].detach())
        assert torch.equal(
            ckpt.read(name, "exp_avg_sq"), optimizer.state[named[name]]["exp_avg_sq"]
        )
    assert ucformat.verify(store).ok
