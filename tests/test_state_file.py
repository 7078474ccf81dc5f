"""``state.json``'s record (``faccel._checkpoint._state_file.StateFile``): one encode, one decode.

Whatever a faccel writes decodes back to the same record, through JSON, and any required key
removed or given a value of the wrong type is one ``CheckpointError`` naming the file and the key,
never a ``KeyError`` or ``AttributeError`` later in a reader.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from faccel._checkpoint._state_file import StateFile
from faccel.errors import CheckpointError
from tests.strategies import state_files

WHERE = "ckpt/state.json"
# Keys every state.json holds (consumed, resumed_at: absent in checkpoints from before them; tensors:
# the sharded format's only).
REQUIRED = (
    "format",
    "step",
    "epoch",
    "position",
    "world_size",
    "model",
    "optimizer",
    "scheduler",
    "scaler",
    "extras",
)
# For each key, values of a type it never holds.
WRONG: dict[str, list[Any]] = {
    "format": ["faccel.checkpoint", 3, None],
    "step": [-1, 1.5, "3", True, None],
    "epoch": [-2, "0", [0], None],
    "position": [2.0, None, {}],
    "world_size": [0, -1, "2", None, 1.0],
    "consumed": [-1, "4", 1.5, True],
    "resumed_at": [[1], [1, -1], "1,2", [1, "2"], [1, 2, 3]],
    "model": [None, [], {"keys": "w", "aliases": {}}, {"keys": ["w"]}, {"keys": [1], "aliases": {}}],
    "optimizer": [[], 3, {"class": "torch.optim.SGD"}, {"state_dict": {}}, {"class": 1, "state_dict": {}}],
    "scheduler": ["StepLR", {"class": None, "state_dict": {}}],
    "scaler": [1, {"scale": 2.0}],
    "extras": [None, [], {"seen": 3}, {"seen": {"kind": "pickle", "value": 3}}, {"seen": {"kind": "value"}}],
}


@settings(max_examples=200, deadline=None)
@given(state=state_files())
def test_encode_then_decode_is_the_same_record_through_json(state: StateFile) -> None:
    raw = json.loads(json.dumps(state.encode(), allow_nan=False))
    assert StateFile.decode(raw, where=WHERE) == state


@settings(max_examples=200, deadline=None)
@given(state=state_files(), key=st.sampled_from(REQUIRED))
def test_a_missing_required_key_is_a_named_error(state: StateFile, key: str) -> None:
    raw = state.encode()
    del raw[key]
    with pytest.raises(CheckpointError, match=f"^{WHERE}: ") as error:
        StateFile.decode(raw, where=WHERE)
    message = str(error.value)
    assert key in message or "format" in message, message


@settings(max_examples=200, deadline=None)
@given(state=state_files(), data=st.data())
def test_a_mistyped_key_is_a_named_error(state: StateFile, data: st.DataObject) -> None:
    key = data.draw(st.sampled_from(sorted(WRONG)))
    value = data.draw(st.sampled_from(WRONG[key]))
    raw = {**state.encode(), key: value}
    with pytest.raises(CheckpointError, match=f"^{WHERE}: ") as error:
        StateFile.decode(raw, where=WHERE)
    message = str(error.value)
    assert key in message or "format" in message, message


def test_checkpoints_from_before_consumed_and_resumed_at_still_decode() -> None:
    raw = {
        "format": "faccel.checkpoint.state",
        "step": 4,
        "epoch": 1,
        "position": 2,
        "world_size": 2,
        "model": {"keys": ["w", "v"], "aliases": {"v": "w"}},
        "optimizer": None,
        "scheduler": None,
        "scaler": {"state_dict": {}},
        "extras": {},
    }
    state = StateFile.decode(raw, where=WHERE)
    assert (state.consumed, state.resumed_at, state.tensors) == (None, None, None)
    assert state.model_aliases == {"v": "w"} and state.scaler is not None and state.scaler.class_name is None


def test_every_problem_is_named_in_one_error() -> None:
    raw = {"format": "faccel.checkpoint.state", "step": -1, "epoch": "x", "position": 0, "world_size": 1}
    with pytest.raises(CheckpointError) as error:
        StateFile.decode(raw, where=WHERE)
    message = str(error.value)
    for words in (
        "step must be",
        "epoch must be",
        "model needs keys",
        "optimizer is missing",
        "extras must be",
    ):
        assert words in message, message
