"""The learner's set-up (peer/daemon/learner_setup.py): resuming from a save or from the signed model, the
renumbering after versions published past the save, and the trainer the run asks for."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
from test_trainer import buffered, options, tiny_model

from heterorl.peer.daemon.learner_setup import make_trainer, model_factory, resume
from heterorl.peer.daemon.main import add_arguments, run
from heterorl.peer.daemon.weights import weights_hash
from heterorl.peer.learner.rows import rows_from_batches
from heterorl.peer.learner.trainer import Trainer, TrainerLike
from heterorl.protocol.settings import AdapterSettings, RunSettings
from heterorl.protocol.storage.jsonlog import append_row, read_rows
from heterorl.protocol.wire.checkpoint import serialize_state_dict

pytestmark = pytest.mark.fast


class Store:
    def __init__(self, versions):
        self._v = list(versions)

    def versions(self):
        return list(self._v)


def settings(initial: bytes, dtype: str = "bfloat16") -> RunSettings:
    s = RunSettings(run_id="r", learner_keys=(b"k" * 32,), vocab_size=100, initial_checkpoint=initial)
    return dataclasses.replace(s, learner=dataclasses.replace(s.learner, checkpoint_dtype=dtype))


def signed(trainer: Trainer) -> bytes:
    return weights_hash(serialize_state_dict(trainer.snapshot("bfloat16", with_state=False).weights))


def test_a_fresh_start_must_be_the_signed_model(tmp_path):
    trainer = Trainer(tiny_model(), options(), pad_id=0)
    assert resume(trainer, settings(signed(trainer)), tmp_path, Store([])) == 0
    other = Trainer(tiny_model(seed=1), options(), pad_id=0)
    with pytest.raises(ValueError, match="differ from the RunSpec's initial checkpoint"):
        resume(other, settings(signed(trainer)), tmp_path, Store([]))


def test_versions_published_after_the_save_are_renumbered_past_and_their_rows_dropped(tmp_path):
    rows = rows_from_batches(buffered(2), pad_id=0)
    trainer = Trainer(tiny_model(), options(), pad_id=0)
    initial = signed(trainer)
    for _ in range(2):
        trainer.step(rows)
    Trainer.save(tmp_path / "state", trainer.snapshot("float32"), {"step": trainer.version})
    for step in range(1, 6):
        append_row(tmp_path / "metrics.jsonl", {"step": step})
    again = Trainer(tiny_model(), options(), pad_id=0)
    saved = resume(again, settings(initial), tmp_path, Store([0, 1, 2, 3, 4, 5]))
    assert saved == 2 and again.version == 5  # the redone updates are versions 6, 7, ...
    assert [r["step"] for r in read_rows(tmp_path / "metrics.jsonl")] == [1, 2]
    # nothing published past the save: the version is the save's, nothing dropped
    third = Trainer(tiny_model(), options(), pad_id=0)
    assert resume(third, settings(initial), tmp_path, Store([0, 1, 2])) == 2 and third.version == 2


def test_one_process_gets_a_plain_trainer_and_the_factory_builds_the_run_model(tiny_model_dir):
    s = settings(b"h" * 32)
    trainer, tok, world = make_trainer(s, tiny_model_dir, "cpu")
    assert world == 1 and isinstance(trainer, Trainer) and isinstance(trainer, TrainerLike)
    built = model_factory(s, tiny_model_dir, "cpu")()
    assert json.dumps(sorted(built.state_dict())) == json.dumps(sorted(trainer.model.state_dict()))
    assert tok.pad_token_id is not None


def test_adapter_runs_refuse_several_ranks(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun: refused before any process group is made
    s = dataclasses.replace(settings(b"h" * 32), adapter=AdapterSettings(base_hash="ab" * 32))
    with pytest.raises(ValueError, match="adapter runs train on one device"):
        make_trainer(s, tiny_model_dir, "cpu")


def test_only_a_learner_runs_on_several_ranks(tmp_path, monkeypatch, capsys):
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(["--state-dir", str(tmp_path), "--nproc", "2"])  # a sampler
    assert run(args) == 2 and "only a learner" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")  # a sampler started by torchrun
    assert run(ap.parse_args(["--state-dir", str(tmp_path)])) == 2
    assert run(ap.parse_args(["--state-dir", str(tmp_path), "--nproc", "0", "--role", "learner"])) == 2
