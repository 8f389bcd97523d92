"""Run settings for real models: chat template mode and the dtype checkpoints travel in."""

from __future__ import annotations

import pytest
import torch

from heterorl.peer.daemon.weights import weights_bytes
from heterorl.protocol.settings import RunSettings, parse_run_config
from heterorl.protocol.wire.checkpoint import deserialize_state_dict

pytestmark = pytest.mark.fast  # in `make test-fast`

KEY = "ab" * 32


def test_chat_mode_travels_in_the_runspec_and_is_validated():
    cfg = parse_run_config({"learner_keys": [KEY], "model": {"chat": "off"}})
    body = cfg.runspec_body(b"\0" * 32, 100)
    assert RunSettings.from_spec(body).model.chat == "off"
    with pytest.raises(ValueError, match="model.chat"):
        parse_run_config({"learner_keys": [KEY], "model": {"chat": "maybe"}})


def test_checkpoint_dtype_is_validated():
    cfg = parse_run_config({"learner_keys": [KEY], "learner": {"checkpoint_dtype": "bfloat16"}})
    assert cfg.learner.checkpoint_dtype == "bfloat16"
    with pytest.raises(ValueError, match="checkpoint_dtype"):
        parse_run_config({"learner_keys": [KEY], "learner": {"checkpoint_dtype": "int8"}})


def test_bf16_checkpoints_are_the_rounding_of_the_float32_master():
    model = torch.nn.Linear(4, 3)
    state = deserialize_state_dict(weights_bytes(model, "bfloat16"))
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert torch.equal(state["weight"], model.weight.detach().to(torch.bfloat16))
    assert len(weights_bytes(model, "bfloat16")) < len(weights_bytes(model))
    with pytest.raises(ValueError, match="checkpoint dtype"):
        weights_bytes(model, "int8")
