"""torch_checkpointing's ``metadata.pkl``: plain data decoded with no global admitted, every
field checked; anything torch_checkpointing 0.1 does not write is refused in one line."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import pytest

from ucformat.errors import NotACheckpointError, UnsafePickleError, UnsupportedCheckpointError
from ucformat.layout.placements import Placement
from ucformat.sources.torch_checkpointing_metadata import read_tc_metadata


def _dtensor(shape: list[int], placements: list[dict[str, Any]], mesh: list[int]) -> Any:
    return [
        {
            "ranks": tuple(mesh),
            "sharding_metadata": {
                "type": "DTensorShardingMetadata",
                "data": {
                    "global_shape": shape,
                    "dtype": "torch.bfloat16",
                    "stride": [1] * len(shape),
                    "mesh_spec": {
                        "device_type": "cpu",
                        "mesh_shape": (2, 2),
                        "mesh_data": tuple(mesh),
                        "mesh_dim_names": ("dp", "tp"),
                    },
                    "placements": placements,
                },
            },
        }
    ]


METADATA: dict[str, Any] = {
    "world_size": 4,
    "version": "2.0",
    "metadata": {
        "model": {
            "nested_path_to_metadata": {
                '["w"]': _dtensor(
                    [8, 4],
                    [
                        {"type": "StridedShard", "dim": 0, "split_factor": 2},
                        {"type": "Shard", "dim": 0},
                    ],
                    [0, 2, 1, 3],
                ),
                '["state", 0, "b"]': _dtensor(
                    [8], [{"type": "Replicate"}, {"type": "Shard", "dim": 0}], [0, 1, 2, 3]
                ),
            },
            "rank_to_layout_info": {
                0: None,
                1: None,
                2: None,
                3: {
                    "file_path": "rank_3/model.safetensors",
                    "serialization_format": {"type": "SafetensorsSerialization"},
                },
            },
        }
    },
}


def _write(tmp_path: Path, metadata: Any) -> Path:
    (tmp_path / "metadata.pkl").write_bytes(pickle.dumps(metadata))
    return tmp_path


def test_what_the_library_writes_is_read(tmp_path: Path) -> None:
    parsed = read_tc_metadata(_write(tmp_path, METADATA))
    assert parsed.world_size == 4 and parsed.version == "2.0"
    item = parsed.items["model"]
    assert item.files == {
        0: "model_0.pt",
        1: "model_1.pt",
        2: "model_2.pt",
        3: "rank_3/model.safetensors",
    }
    assert item.formats[3] == "SafetensorsSerialization"
    w = item.tensors[("w",)]
    assert (w.dtype, w.shape, w.mesh_shape, w.mesh_ranks) == (
        "bfloat16",
        (8, 4),
        (2, 2),
        (0, 2, 1, 3),
    )
    assert w.placements == (Placement("strided", 0, 2), Placement("shard", 0))
    assert item.tensors[("state", 0, "b")].placements[0] == Placement("replicate")


def _changed(path: list[Any], value: Any) -> dict[str, Any]:
    metadata = copy.deepcopy(METADATA)
    target = metadata
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return metadata


ITEM = ["metadata", "model"]
W = [*ITEM, "nested_path_to_metadata", '["w"]', 0, "sharding_metadata"]


@pytest.mark.parametrize(
    ("path", "value", "kind", "expected"),
    [
        (["version"], "1.0", UnsupportedCheckpointError, "metadata version 1.0"),
        (["world_size"], 0, NotACheckpointError, "world_size 0"),
        ([*ITEM, "rank_to_layout_info", 4], None, NotACheckpointError, "names rank 4"),
        (
            [*ITEM, "rank_to_layout_info", 3, "file_path"],
            "../x.pt",
            NotACheckpointError,
            "not a relative path inside",
        ),
        (
            [*ITEM, "rank_to_layout_info", 3, "file_path"],
            "/etc/passwd",
            NotACheckpointError,
            "not a relative path inside",
        ),
        (
            [*ITEM, "rank_to_layout_info", 3, "serialization_format"],
            {"type": "Pickle"},
            UnsupportedCheckpointError,
            "stored as Pickle",
        ),
        ([*W, "type"], "default_tensor_v1", UnsupportedCheckpointError, "DTensorShardingMetadata"),
        (
            [*W, "data", "dtype"],
            "torch.float8_e4m3fn",
            UnsupportedCheckpointError,
            "cannot be stored",
        ),
        ([*W, "data", "mesh_spec", "mesh_data"], (0, 0, 1, 3), NotACheckpointError, "is not valid"),
        ([*W, "data", "mesh_spec", "mesh_data"], (0, 1, 2, 9), NotACheckpointError, "is not valid"),
        (
            [*W, "data", "placements"],
            [{"type": "Partial"}, {"type": "Shard", "dim": 0}],
            NotACheckpointError,
            "is not Shard, StridedShard or Replicate",
        ),
        (
            [*W, "data", "placements"],
            [{"type": "Shard", "dim": 2}, {"type": "Replicate"}],
            NotACheckpointError,
            "is not Shard",
        ),
        ([*W, "data", "global_shape"], [8, -4], NotACheckpointError, "global_shape"),
    ],
)
def test_anything_else_is_refused_in_one_line(
    tmp_path: Path, path: list[Any], value: Any, kind: type[Exception], expected: str
) -> None:
    with pytest.raises(kind) as info:
        read_tc_metadata(_write(tmp_path, _changed(path, value)))
    assert expected in str(info.value) and "\n" not in str(info.value)
    assert "metadata.pkl" in str(info.value)


def test_a_pickled_object_of_any_class_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsafePickleError, match="pathlib"):
        read_tc_metadata(_write(tmp_path, {**METADATA, "world_size": Path("x")}))


def test_a_missing_rank_is_refused(tmp_path: Path) -> None:
    metadata = copy.deepcopy(METADATA)
    del metadata["metadata"]["model"]["rank_to_layout_info"][2]
    with pytest.raises(NotACheckpointError, match=r"lists ranks \[0, 1, 3\], not 0..3"):
        read_tc_metadata(_write(tmp_path, metadata))


def test_a_tensor_subclass_other_than_dtensor_is_refused(tmp_path: Path) -> None:
    """Item files may hold DTensors (rebuilt as records); any other wrapper subclass is
    refused, nothing of it built."""
    import torch

    from tests.hostile import Payload, replace_data_pkl
    from ucformat.sources.torchfile import open_torch_file

    path = tmp_path / "model_0.pt"
    torch.save({"w": torch.ones(2)}, path)
    args = (torch.Tensor, torch.float32, (2,), (1,), 0, torch.strided, torch.device("cpu"), False)
    rebuilt = Payload(
        torch._tensor._rebuild_from_type_v2,
        torch._utils._rebuild_wrapper_subclass,
        torch.Tensor,
        args,
        {},
    )
    replace_data_pkl(path, {"w": rebuilt})
    with pytest.raises(UnsafePickleError, match="not a DTensor"):
        open_torch_file(path)
