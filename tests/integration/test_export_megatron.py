"""``ucformat export megatron``: the files, against the checkpoints Megatron-Core itself wrote.

Exported at the source's own layout and optimizer kind, an export's ``.metadata`` must name the
same tensor keys, global shapes and dtypes as Megatron's own checkpoint, cut into the same boxes
written by the same ranks: that proves the tensor / pipeline / expert split rules of
:mod:`ucformat.layout.megatron` on every case of :mod:`tests.fixtures.megatron_cases`. Then
``common.pt`` for each optimizer kind, the destination rules and the refusals (CLI exit code 2,
one line). Loading and training on the exports is tests/integration/test_megatron_resume.py.
No torchrun launch here (the source checkpoints are cached fixtures).
"""

from __future__ import annotations

import importlib.util
import itertools
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import ucformat
from tests.cli.helpers import assert_user_error, invoke
from tests.fixtures.megatron_cases import CASES, generate_megatron
from ucformat.export.megatron import TRACKER, export_megatron
from ucformat.sources.dcp_metadata import DcpTensor, read_dcp_metadata

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (the 'megatron' extra)",
)

#: (case, format saved, distributed optimizer): every layout of the grid.
SOURCES = [
    ("tp2-fp32", "none", False),
    ("tp2-bf16", "none", False),
    ("tp2dp2", "fully_reshardable", True),
    ("pp2-uneven", "fully_reshardable", True),
    ("pp2tp2-vpp2", "fully_reshardable", True),
    ("ep2", "none", False),
    ("ep2-grouped", "fully_reshardable", True),
    ("ep2-etp2", "fully_reshardable", True),
]
_CHAINED = re.compile(r"^chained_\d+\.")
_DATA_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folders = generate_megatron(sorted({case for case, _, _ in SOURCES} | {"dp2-bf16"}))
    work = tmp_path_factory.mktemp("megatron-export")
    out = {}
    for case, fmt, _ in [*SOURCES, ("dp2-bf16", "dp_reshardable", True)]:
        out[case] = work / f"{case}.ucf"
        ucformat.convert(folders[case] / fmt, out[case])
    return out


def _axes(key: str) -> int:
    """Leading dims that index parameters: the layer axis, then the expert axis."""
    if not key.startswith("decoder.layers.") and ".decoder.layers." not in key:
        return 0
    return 2 if "experts.experts." in key else 1


def _boxes(folder: Path) -> dict[str, tuple[tuple[int, ...], str, set[tuple[Any, ...]]]]:
    """Tensor key (``chained_<i>.`` dropped) -> (shape, dtype, {(writer rank, offsets, sizes)}),
    each box cut into one per parameter (GroupedMLP writes a rank's experts as one box)."""
    metadata = read_dcp_metadata(folder)
    out = {}
    for key, entry in metadata.entries.items():
        if not isinstance(entry, DcpTensor):
            continue
        boxes = set()
        count = _axes(key)
        for chunk in entry.chunks:
            item = metadata.items[(key, chunk.offsets)]
            match = _DATA_FILE.match(item.relative_path)
            assert match is not None, item.relative_path
            for at in itertools.product(*(range(n) for n in chunk.sizes[:count])):
                lead = (o + i for o, i in zip(chunk.offsets[:count], at, strict=True))
                offsets = (*lead, *chunk.offsets[count:])
                sizes = (*(1 for _ in at), *chunk.sizes[count:])
                boxes.add((int(match.group(1)), offsets, sizes))
        out[_CHAINED.sub("", key)] = (entry.shape, entry.dtype, boxes)
    return out


@pytest.mark.parametrize(("case", "fmt", "distributed"), SOURCES, ids=[c for c, _, _ in SOURCES])
def test_export_at_the_sources_layout_writes_megatrons_own_boxes(
    stores: dict[str, Path], case: str, fmt: str, distributed: bool, tmp_path: Path
) -> None:
    source = CASES[case]
    result = export_megatron(
        stores[case], tmp_path, tp=source.tp, pp=source.pp, ep=source.ep,
        distributed_optimizer=distributed,
    )  # fmt: skip
    ours = _boxes(tmp_path / "iter_0000002")
    theirs = _boxes(generate_megatron([case])[case] / fmt)
    assert ours.keys() == theirs.keys()
    for key, (shape, dtype, boxes) in theirs.items():
        assert ours[key][:2] == (shape, dtype), key
        assert ours[key][2] == boxes, key
    assert (tmp_path / TRACKER).read_text() == "2"
    assert result.files[-1] == TRACKER


def test_common_state_for_each_optimizer_kind(stores: dict[str, Path], tmp_path: Path) -> None:
    """``common.pt`` holds what each Megatron optimizer keeps outside its tensors."""
    common = {}
    for name, distributed, dtype in (
        ("plain", False, "fp32"), ("dist", True, "fp32"), ("half", False, "bf16"),
    ):  # fmt: skip
        export_megatron(
            stores["tp2-fp32"], tmp_path / name, tp=1, distributed_optimizer=distributed,
            dtype=dtype,
        )  # fmt: skip
        common[name] = torch.load(
            tmp_path / name / "iter_0000002" / "common.pt", weights_only=False
        )
    manifest = ucformat.open(stores["tp2-fp32"]).manifest
    assert manifest.optimizer is not None
    stored = [g.hyperparams for g in manifest.optimizer.groups]
    plain = common["plain"]["optimizer"]
    assert set(plain) == {"state", "param_groups"}  # FP32Optimizer
    assert torch.equal(plain["state"]["common_step"], torch.tensor(2.0))
    assert [g["wd_mult"] for g in plain["param_groups"]] == [s["wd_mult"] for s in stored]
    assert all("step" not in g and "params" not in g for g in plain["param_groups"])
    half = common["half"]["optimizer"]["optimizer"]  # Float16OptimizerWithFloat16Params
    assert set(half) == {"state", "param_groups"}
    dist = common["dist"]["optimizer"]
    assert dist["param_state_sharding_type"] == "fully_reshardable"
    assert [g["step"] for g in dist["optimizer"]["param_groups"]] == [2.0, 2.0]
    assert common["dist"]["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert "distrib_optim_sharding_type" not in common["plain"]["content_metadata"]
    for value in common.values():
        args = value["args"]
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (1, 1)
        assert args.no_save_rng and value["iteration"] == 2
        assert args.num_layers == 2 and args.hidden_size == 32  # the run's own args
    assert common["dist"]["args"].use_distributed_optimizer
    assert common["half"]["args"].bf16
    assert "opt_param_scheduler" in common["plain"]
    assert "rng_state" not in common["plain"]


def test_moe_export_chains_a_dense_and_an_expert_optimizer(
    stores: dict[str, Path], tmp_path: Path
) -> None:
    export_megatron(stores["ep2-grouped"], tmp_path, ep=2)
    common = torch.load(tmp_path / "iter_0000002" / "common.pt", weights_only=False)
    chain = common["optimizer"]
    assert sorted(chain) == [0, 1]
    assert not any(g["is_expert_parallel"] for g in chain[0]["optimizer"]["param_groups"])
    assert all(g["is_expert_parallel"] for g in chain[1]["optimizer"]["param_groups"])
    assert common["args"].expert_model_parallel_size == 2


def test_dry_run_and_destination_rules(stores: dict[str, Path], tmp_path: Path) -> None:
    store = stores["tp2-fp32"]
    out = tmp_path / "run"
    dry = invoke("export", "megatron", store, out, "--tp", "2", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "would write Megatron-Core torch_dist iteration 2 for TP=2" in dry.output
    assert not out.exists()
    assert invoke("export", "megatron", store, out).exit_code == 0
    again = invoke("export", "megatron", store, out, "--tp", "2")
    assert_user_error(again, "iter_0000002: already exists")
    replaced = invoke("export", "megatron", store, out, "--tp", "2", "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    assert_user_error(invoke("export", "megatron", store, other), "not a Megatron-LM")
    # a Megatron-LM folder with another iteration gets this one beside it, the tracker moves
    older = tmp_path / "older"
    (older / "iter_0000001").mkdir(parents=True)
    (older / TRACKER).write_text("1")
    result = invoke("export", "megatron", store, older)
    assert result.exit_code == 0, result.output
    assert (older / TRACKER).read_text() == "2" and (older / "iter_0000001").is_dir()
    assert "latest_checkpointed_iteration.txt: 1 -> 2" in result.output


def test_layouts_that_cannot_hold_the_model_are_refused(
    stores: dict[str, Path], tmp_path: Path
) -> None:
    store = stores["tp2-fp32"]
    assert_user_error(
        invoke("export", "megatron", store, tmp_path / "a", "--tp", "3"),
        "not divisible by --tp 3",
    )
    assert_user_error(
        invoke("export", "megatron", store, tmp_path / "b", "--ep", "2"), "has no experts"
    )
    assert_user_error(
        invoke("export", "megatron", stores["ep2"], tmp_path / "c", "--ep", "3"),
        "4 experts do not split evenly into --ep 3",
    )
    assert_user_error(
        invoke("export", "megatron", stores["pp2-uneven"], tmp_path / "d", "--pp", "2",
               "--first-stage-layers", "2", "--last-stage-layers", "2"),
        "3 layers do not split",
    )  # fmt: skip
    assert not any((tmp_path / n).exists() for n in "abcd")


def test_a_store_not_from_megatron_is_refused(tmp_path: Path) -> None:
    source = next((Path(__file__).resolve().parents[1] / "fixtures" / "data").glob("*/ckpt"))
    store = tmp_path / "ds.ucf"
    ucformat.convert(source, store)
    assert_user_error(
        invoke("export", "megatron", store, tmp_path / "out"),
        "not converted from a Megatron-Core checkpoint",
    )


def test_dp_reshardable_store_exports_to_a_new_tp(stores: dict[str, Path], tmp_path: Path) -> None:
    """A dp_reshardable run (Megatron reshards it only along DP) at TP=2: the keys and shapes of
    a TP=2 job, every optimizer state in the fully_reshardable form."""
    export_megatron(stores["dp2-bf16"], tmp_path, tp=2)
    boxes = _boxes(tmp_path / "iter_0000002")
    qkv = boxes["decoder.layers.self_attention.linear_qkv.weight"]
    assert qkv[1] == "bfloat16" and {(r, o) for r, o, _ in qkv[2]} == {
        (0, (0, 0, 0)), (1, (0, 32, 0)), (0, (1, 0, 0)), (1, (1, 32, 0)),
    }  # fmt: skip
    assert boxes["optimizer.state.param.decoder.layers.self_attention.linear_qkv.weight"][1] == (
        "float32"
    )


def test_hugging_face_names_refuse_what_does_not_fit(
    stores: dict[str, Path], tmp_path: Path
) -> None:
    """Llama is dense, Mixtral has no shared experts: one line each."""
    assert_user_error(
        invoke("export", "safetensors", stores["ep2-grouped"], tmp_path / "a", "--names",
               "hf-llama"),
        "use --names hf-mixtral",
    )  # fmt: skip
    assert_user_error(
        invoke("export", "safetensors", stores["ep2"], tmp_path / "b", "--names", "hf-mixtral"),
        "mlp.shared_experts.linear_fc1.weight': Hugging Face Mixtral has no parameter for it",
    )
    assert_user_error(
        invoke("export", "safetensors", stores["tp2-fp32"], tmp_path / "c", "--names",
               "hf-mixtral"),
        "no experts: use --names hf-llama",
    )  # fmt: skip
