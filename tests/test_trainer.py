"""The Trainer seam: it scores rows under its own or another version's weights, steps, snapshots what a
version publishes, and saves and restores its whole state; and the batch assembler that feeds it."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from heterorl.peer.learner.assembler import BatchAssembler
from heterorl.peer.learner.buffer import Buffered, TrajectoryBuffer
from heterorl.peer.learner.rows import Rows, rows_from_batches
from heterorl.peer.learner.trainer import Trainer, TrainerLike
from heterorl.peer.learner.update import StepOptions, accumulate_gradients
from heterorl.peer.model import completion_logprobs
from heterorl.protocol.settings import AdapterSettings

pytestmark = pytest.mark.fast

V, T = 37, 4


def options(**kw) -> StepOptions:
    base = dict(
        objective="gepo",
        advantage=None,
        objective_params={},
        temperature=1.0,
        max_new_tokens=T,
        lr=1e-2,
        grad_clip=1.0,
    )
    return StepOptions(**{**base, **kw})


def tiny_model(seed: int = 0):
    from transformers import LlamaForCausalLM

    from heterorl.peer.model.tiny import build_config

    torch.manual_seed(seed)
    return LlamaForCausalLM(build_config(V, hidden=16, layers=1, heads=2, max_len=32)).eval()


def body(batch_id: bytes, version: int, groups: int = 2, group_size: int = 2) -> dict:
    g = torch.Generator().manual_seed(batch_id[0])
    rows = []
    for i in range(groups * group_size):
        k = 1 + i % T
        rows.append(
            {
                "group": i // group_size,
                "prompt_ids": [1, *torch.randint(3, V, (1 + i % 3,), generator=g).tolist()],
                "completion_ids": torch.randint(3, V, (k,), generator=g).tolist(),
                "logprobs": [-3.0] * k,
                "reward": float(i % 2),
            }
        )
    return {"batch_id": batch_id, "policy_version": version, "rows": rows}


def buffered(n: int, version: int = 0) -> list[Buffered]:
    return [Buffered(bytes([i + 1]) * 16, bytes([100 + i]) * 32, body(bytes([i + 1]) * 16, version), 0.0)
            for i in range(n)]  # fmt: skip


@pytest.fixture(scope="module")
def rows() -> Rows:
    torch.set_num_threads(1)
    return rows_from_batches(buffered(2), pad_id=0)


def test_rows_carry_author_and_batch_id_to_every_row(rows):
    batches = buffered(2)
    assert len(rows) == 8
    assert rows.authors == [batches[0].author] * 4 + [batches[1].author] * 4
    assert rows.batch_ids == [batches[0].batch_id] * 4 + [batches[1].batch_id] * 4
    assert rows.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]  # each batch's groups stay its own
    with pytest.raises(ValueError, match="authors"):
        Rows(rows.prompts, rows.completions, rows.mask, rows.logq, rows.rewards, rows.group_ids,
             rows.versions, authors=[b"x"])  # fmt: skip


def test_a_snapshot_holds_its_version_while_training_goes_on_and_renumber_only_goes_forward(rows):
    trainer = Trainer(tiny_model(), options(), pad_id=0)
    assert isinstance(trainer, TrainerLike)

    def logprobs(model):
        with torch.no_grad():
            return completion_logprobs(model, rows.prompts, rows.completions, rows.mask, 0)

    before = logprobs(trainer.model)
    v0 = trainer.snapshot("float32", with_state=False)
    trainer.step(rows)
    assert trainer.version == 1 and not torch.allclose(logprobs(trainer.model), before)
    replay = tiny_model()
    replay.load_state_dict(v0.weights)
    torch.testing.assert_close(logprobs(replay), before)  # version 0's weights, untouched by the step
    trainer.renumber(5)
    assert trainer.version == 5
    with pytest.raises(ValueError, match="back"):
        trainer.renumber(4)


def test_step_zeroes_clips_and_steps_the_optimizer_it_owns(rows):
    trainer = Trainer(tiny_model(), options(grad_clip=1e-3), pad_id=0)
    first = [p.detach().clone() for p in trainer.model.parameters()]
    stats = trainer.step(rows)
    assert stats["grad_norm"] > 1e-3  # clipped to 1e-3 before AdamW's step
    assert not any(torch.equal(a, b) for a, b in zip(first, trainer.model.parameters(), strict=True))
    fresh = copy.deepcopy(trainer.model)  # the gradient of step 2 alone, from zero
    accumulate_gradients(fresh, rows, trainer.options, version=1, pad_id=0)
    stats = trainer.step(rows)  # zero_grad first: step 1's gradient is not added in
    grads = [q.grad for q in fresh.parameters() if q.grad is not None]
    assert stats["grad_norm"] == pytest.approx(
        float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))), rel=1e-5
    )
    for p, q in zip(trainer.model.parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad * (1e-3 / stats["grad_norm"]))  # clipped in place
    assert isinstance(trainer.optimizer, torch.optim.AdamW) and trainer.version == 2
    assert stats["time/fwd_bwd_s"] > 0 and not trainer.model.training


def test_a_snapshot_is_a_copy_and_rounds_to_the_checkpoint_dtype(rows):
    trainer = Trainer(tiny_model(), options(), pad_id=0)
    snap = trainer.snapshot("bfloat16")
    kept = {k: v.clone() for k, v in snap.weights.items()}
    trainer.step(rows)  # in place: the snapshot must not move with it
    assert all(torch.equal(kept[k], snap.weights[k]) for k in kept)
    assert all(v.dtype == torch.bfloat16 for v in snap.weights.values() if v.is_floating_point())
    live = trainer.model.state_dict()
    assert not all(torch.equal(snap.model_state[k], live[k]) for k in live)
    assert snap.optimizer_state["state"] == {}  # taken before the first step
    f32 = trainer.snapshot("float32")
    assert all(f32.weights[k] is f32.model_state[k] for k in f32.weights)  # one copy serves both
    tied = trainer.model.lm_head.weight.data_ptr() == trainer.model.model.embed_tokens.weight.data_ptr()
    assert tied and snap.weights["lm_head.weight"] is snap.weights["model.embed_tokens.weight"]  # still tied


def test_save_and_restore_reproduce_the_next_step_exactly(rows, tmp_path):
    a = Trainer(tiny_model(), options(), pad_id=0)
    a.step(rows)
    Trainer.save(tmp_path, a.snapshot("float32"), {"run_id": "r"})
    b = Trainer(tiny_model(seed=1), options(), pad_id=0)
    assert b.restore(tmp_path) == {"run_id": "r", "step": 1} and b.version == 1
    a.step(rows)
    b.step(rows)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert Trainer(tiny_model(), options(), pad_id=0).restore(tmp_path / "none") is None
    with pytest.raises(ValueError, match="no state"):
        Trainer.save(tmp_path, a.snapshot("float32", with_state=False), {})


def test_an_adapter_runs_snapshot_carries_the_adapters_alone(rows):
    from heterorl.peer.model import adapter

    settings = AdapterSettings(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj"))
    trainer = Trainer(adapter.wrap(tiny_model(), settings), options(), pad_id=0, adapter=True)
    trainer.step(rows)
    names = set(trainer.snapshot("float32", with_state=False).weights)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert names == set(adapter.adapter_state(trainer.model))


def test_the_assembler_builds_the_next_batch_while_the_current_one_trains():
    buf = TrajectoryBuffer(capacity=8)
    asm = BatchAssembler(buf, lambda: 4, pad_id=0)
    thread = threading.Thread(target=asm.run, daemon=True)
    thread.start()
    batches = buffered(4)
    for b in batches:
        buf.put(b)
    first = asm.take(timeout=10)
    assert first is not None and [b.batch_id for b in first.batches] == [b.batch_id for b in batches[:2]]
    assert first.rows.authors[0] == batches[0].author and len(first.rows) == 8
    # the second is assembled without anyone asking: it waits, ready, while the first "trains"
    with asm._cond:
        assert asm._cond.wait_for(lambda: asm.assembled == 2, 10)
    second = asm.take(timeout=10)
    assert [b.batch_id for b in second.batches] == [b.batch_id for b in batches[2:]]
    assert len(buf) == 0
    assert asm.take(timeout=0.05) is None  # nothing more to assemble
    asm.close()  # wakes the thread blocked on the empty buffer and any taker
    thread.join(10)
    assert not thread.is_alive() and asm.take() is None
