"""ucformat.lightning.state: Lightning's checkpoint dictionary in a store's client state."""

from __future__ import annotations

from typing import Any

import pytest

from ucformat.errors import UCFormatError
from ucformat.format.models import CheckpointManifest, ClientState, TrainingProgress
from ucformat.format.training_values import encode_client_state
from ucformat.lightning.state import lightning_state, split_lightning_state

CHECKPOINT: dict[str, Any] = {
    "epoch": 1,
    "global_step": 3,
    "pytorch-lightning_version": "2.6.6",
    "state_dict": {"w": object()},
    "optimizer_states": [object()],
    "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1}}}},
    "lr_schedulers": [{"last_epoch": 3, "gamma": 0.5, "_last_lr": [0.000125]}],
    "callbacks": {"ModelCheckpoint{}": {"best_model_score": None, "best_k_models": {}}},
    "hyper_parameters": {"config": object(), "lr": 0.1},
}


def _manifest(client: ClientState, steps: int = 0) -> CheckpointManifest:
    return CheckpointManifest.model_validate(
        {
            "created_by": "test",
            "source": {
                "framework_version": "x",
                "path": "",
                "tag": "",
                "zero_stage": 2,
                "world_size": 1,
                "train_dtype": "float32",
            },
            "params": {},
            "client_state": client.model_dump(),
            "progress": TrainingProgress(global_steps=steps).model_dump(),
        }
    )


def test_everything_but_the_tensors_round_trips_exactly() -> None:
    client, by_type = split_lightning_state(CHECKPOINT)
    assert by_type == ["hyper_parameters"]  # an object: kept by type, not restored
    assert not any(key.endswith(("state_dict", "optimizer_states")) for key in client)
    back = lightning_state(_manifest(encode_client_state(client.items())), "9.9")
    expected = {
        k: v
        for k, v in CHECKPOINT.items()
        if k not in ("state_dict", "optimizer_states", "hyper_parameters")
    }
    assert back == expected


@pytest.mark.parametrize("key", ["loops", "lr_schedulers", "callbacks"])
def test_state_lightning_restores_must_be_exact(key: str) -> None:
    with pytest.raises(UCFormatError, match=f"entry '{key}'.*nothing was written"):
        split_lightning_state({**CHECKPOINT, key: {"x": object()}})


def test_a_store_lightning_did_not_write_resumes_weights_only() -> None:
    state = lightning_state(_manifest(ClientState(), steps=7), "2.6.6")
    assert state["global_step"] == 7 and state["lr_schedulers"] == []
    assert "loops" not in state and state["pytorch-lightning_version"] == "2.6.6"
