"""The sharded trainer (peer/learner/fsdp.py) on 2 CPU ranks (gloo) against the 1-rank Trainer on the same
batches: GEPO with groups that span the ranks' split, micro-batched and not; the weights after K steps, the
published bf16 checkpoint bytes, tied weights, and saves that cross from 2 ranks to 1 and from 1 to 2.

One launch of 2 ranks (rank 0 a RankLeader, rank 1 following, as a learner runs them) does every sharded
part and leaves its results in files; the tests compare them with Trainers run here.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from heterorl.peer.learner.rows import Rows
from heterorl.peer.learner.trainer import Trainer, TrainerLike
from heterorl.peer.learner.update import StepOptions
from heterorl.peer.model import completion_logprobs
from heterorl.protocol.wire.checkpoint import deserialize_state_dict, serialize_state_dict

V, N, T, K = 41, 11, 5, 3
# float32 on the CPU: the ranks' gradient is a sum of two partial backwards (another order of float additions
# than one rank's), over other micro-batches (other padding widths); AdamW (lr 1e-2) then normalises small
# gradient differences into visible weight differences. Measured after K=3 steps: max |w_2 ranks - w_1 rank|
# 1.5e-6 (micro, clipped) and 9.5e-7 (direct), on weights of ~3e-2; the bound leaves 6x room
TOL = 1e-5
CASES = {  # name: step options (micro_batch_tokens 20: batch 0's 6 | 5 rows go in 4 | 3 forwards, + 1 idle)
    "micro": dict(micro_batch_tokens=20, tis_cap=2.0, grad_clip=0.1),  # grad norms ~0.1-0.3: clipped
    "direct": dict(),
}
RESUMED_FROM_ONE_RANK = "resumed"  # the 2 ranks restore the 1-rank save made after step 1 and take step 2


def options(**kw) -> StepOptions:
    base = dict(objective="gepo", advantage=None, objective_params={}, temperature=1.0, max_new_tokens=T,
                lr=1e-2, grad_clip=1.0)  # fmt: skip
    return StepOptions(**{**base, **kw})


def tiny_model(seed: int = 0):
    from transformers import LlamaForCausalLM

    from heterorl.peer.model.tiny import build_config

    torch.manual_seed(seed)
    return LlamaForCausalLM(build_config(V, hidden=32, layers=2, heads=4, max_len=64)).eval()


def batch(i: int, version: int) -> Rows:
    """11 rows (the ranks split them 6 | 5) in groups of 4, 4, 3: the middle group spans the split; ragged
    prompts and completions; half the rows sampled with ``version`` (fresh), the rest 1 version stale."""
    g = torch.Generator().manual_seed(100 + i)
    prompts = [[1, *torch.randint(3, V, (1 + (r * 3 + i) % 5,), generator=g).tolist()] for r in range(N)]
    lengths = torch.tensor([1 + (r + i) % T for r in range(N)])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    return Rows(
        prompts=prompts,
        completions=torch.randint(3, V, (N, T), generator=g) * mask,
        mask=mask,
        logq=(-2.0 - torch.rand(N, T, generator=g)) * mask,
        rewards=torch.randint(0, 2, (N,), generator=g).float(),
        group_ids=torch.tensor([0] * 4 + [1] * 4 + [2] * 3),
        versions=torch.tensor([version if r % 2 == 0 else max(version - 1, 0) for r in range(N)]),
    )


def one_rank(name: str, steps: int) -> tuple[Trainer, list[dict]]:
    """A 1-rank Trainer after ``steps`` steps of case ``name``, and its stats."""
    trainer = Trainer(tiny_model(), options(**CASES[name]), pad_id=0)
    return trainer, [trainer.step(batch(i, trainer.version)) for i in range(steps)]


def one_rank_trainer(name: str, steps: int) -> Trainer:
    return one_rank(name, steps)[0]


# ---- the ranks' side ----


def sharded(out: Path) -> int:
    from heterorl.peer.learner.fsdp import ShardedTrainer
    from heterorl.peer.learner.ranks import RankLeader, follow, init_from_env

    torch.set_num_threads(1)
    rank, world, device = init_from_env(timeout_s=120)
    results = {}
    for name in [*CASES, RESUMED_FROM_ONE_RANK]:
        seed, opts = (1, options()) if name == RESUMED_FROM_ONE_RANK else (0, options(**CASES[name]))
        trainer = ShardedTrainer(tiny_model(seed).to(device), opts, pad_id=0)
        assert isinstance(trainer, TrainerLike)
        tied = trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight
        if rank > 0:
            if follow(trainer) != 0:
                return 1
            continue
        with RankLeader(trainer) as leader:
            if name == RESUMED_FROM_ONE_RANK:
                meta = leader.restore(out / "one-rank-state")
                stats = [leader.step(batch(1, leader.version))]
                results[name] = {
                    "meta": meta,
                    "stats": stats,
                    "state": leader.snapshot("float32").model_state,
                }
                continue
            stats = [leader.step(batch(i, leader.version)) for i in range(K)]
            published = leader.snapshot("bfloat16", with_state=False)
            snap = leader.snapshot("float32")
            leader.save(out / name / "state", snap, {"run_id": "r"})
            stats.append(leader.step(batch(K, leader.version)))  # the step after the save
            after = leader.snapshot("float32", with_state=False)
        weights = published.weights
        results[name] = {
            "stats": stats,
            "tied": tied,
            "published_tied": weights["lm_head.weight"] is weights["model.embed_tokens.weight"],
            "published": serialize_state_dict(weights),
            "published_dtypes": {v.dtype for v in weights.values()},
            "state": snap.model_state,
            "optimizer": snap.optimizer_state,
            "after": after.weights,
        }
    if rank == 0:
        torch.save(results, out / "results.pt")
    return 0


# ---- the tests ----


@pytest.mark.fast
def test_each_rank_gets_a_contiguous_slice_and_every_rank_runs_as_many_forwards():
    from heterorl.peer.learner.update import _rank_spans, rank_slice

    assert [rank_slice(11, (r, 2)) for r in range(2)] == [(0, 6), (6, 11)]
    assert [rank_slice(2, (r, 3)) for r in range(3)] == [(0, 1), (1, 2), (2, 2)]  # rank 2: no rows
    with pytest.raises(ValueError, match="outside"):
        rank_slice(4, (2, 2))
    rows = batch(0, 0)
    spans = [_rank_spans(rows, 20, (r, 2)) for r in range(2)]
    assert [len(s) for s in spans] == [4, 4]
    assert [sum(live for *_, live in s) for s in spans] == [4, 3]
    assert spans[1][-1] == (6, 7, False)  # rank 1 scores its first row again, with a zero cotangent
    covered = [i for s in spans for a, b, live in s if live for i in range(a, b)]
    assert covered == list(range(N))
    one = dataclasses.replace(rows, prompts=rows.prompts[:1])  # the spans look at the prompts alone
    assert _rank_spans(one, None, (1, 2)) == [(0, 1, False)]  # no rows: one idle forward all the same


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The 2 ranks' results, given the 1-rank save they resume from."""
    from test_ranks import launch, logs, wait_all

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("fsdp")
    seeded = one_rank_trainer("direct", 1)
    Trainer.save(out / "one-rank-state", seeded.snapshot("float32"), {"run_id": "one"})
    procs = launch(Path(__file__), "sharded", out)
    assert wait_all(procs, out, timeout=240) == [0, 0], logs(out)
    return torch.load(out / "results.pt", weights_only=False) | {"out": out}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.slow  # the 2 ranks: ~15 s
@pytest.mark.parametrize("name", list(CASES))
def test_k_sharded_steps_match_one_rank_within_tolerance(run, name):
    got = run[name]
    ref, ref_stats = one_rank(name, K)
    diff = max_diff(got["state"], {k: v.detach() for k, v in ref.model.state_dict().items()})
    print(f"{name}: max |w_2ranks - w_1rank| after {K} steps = {diff:.3g}")
    assert diff <= TOL
    for theirs, mine in zip(got["stats"], ref_stats, strict=False):  # the objective's, on the full batch
        keys = [k for k in mine if k.split("/")[0] not in ("time", "mem", "learner")]  # not this rank's own
        assert {"loss", "grad_norm", "gepo/log_expectation", "mismatch/abs_max"} <= set(keys)
        assert ("tis/mean" in keys) == (name == "micro")
        for key in keys:
            assert theirs[key] == pytest.approx(mine[key], rel=1e-4, abs=1e-6), key
        assert theirs["mem/peak_mib_max"] >= theirs["mem/peak_mib"] > 0
    forwards = 4 if name == "micro" else 1  # micro: rank 0's 6 rows in 4, rank 1's 5 in 3 and an idle one
    assert got["stats"][0]["learner/micro_batches"] == forwards


@pytest.mark.slow
def test_the_published_bf16_checkpoint_matches_one_rank_and_ties_stay_tied(run):
    got = run["micro"]
    assert got["tied"] and got["published_tied"] and got["published_dtypes"] == {torch.bfloat16}
    mine = one_rank_trainer("micro", K).snapshot("bfloat16", with_state=False)
    ref = serialize_state_dict(mine.weights)
    if got["published"] == ref:
        return
    # the float32 weights differ by up to TOL, so some round to bf16 otherwise: by TOL + one bf16 step at most
    theirs = deserialize_state_dict(got["published"])
    assert theirs.keys() == mine.weights.keys()
    differ = total = 0
    for k, v in theirs.items():
        a, b = v.float(), mine.weights[k].float()
        step = torch.finfo(torch.bfloat16).eps * torch.maximum(a.abs(), b.abs())
        assert ((a - b).abs() <= TOL + step).all(), k
        differ, total = differ + int((a != b).sum()), total + a.numel()
    print(f"published bf16: {differ} of {total} values differ")
    assert differ <= total // 1000  # measured: 6 of 35 552


@pytest.mark.slow
def test_a_save_from_two_ranks_restores_on_one_and_the_next_step_matches(run):
    got = run["micro"]
    trainer = Trainer(tiny_model(seed=1), options(**CASES["micro"]), pad_id=0)
    assert trainer.restore(run["out"] / "micro" / "state") == {"run_id": "r", "step": K}
    assert trainer.version == K
    live = trainer.model.state_dict()
    assert all(torch.equal(live[k], v) for k, v in got["state"].items())  # the same weights, exactly
    reference = one_rank_trainer("micro", K).snapshot("float32").optimizer_state
    assert got["optimizer"]["param_groups"] == reference["param_groups"]  # Trainer's format: by index
    assert got["optimizer"]["state"].keys() == reference["state"].keys()
    for i, per_param in reference["state"].items():
        for key, v in per_param.items():
            assert got["optimizer"]["state"][i][key].shape == v.shape
            assert float((got["optimizer"]["state"][i][key].float() - v.float()).abs().max()) <= TOL
    trainer.step(batch(K, trainer.version))  # the 2 ranks took this step after their save
    assert max_diff(trainer.snapshot("float32", with_state=False).weights, got["after"]) <= TOL


@pytest.mark.slow
def test_a_save_from_one_rank_restores_on_two_and_the_next_step_matches(run):
    got = run[RESUMED_FROM_ONE_RANK]
    assert got["meta"] == {"run_id": "one", "step": 1}
    ref = one_rank_trainer("direct", 2)  # the 1-rank run that made the save, one step further
    assert max_diff(got["state"], {k: v.detach() for k, v in ref.model.state_dict().items()}) <= TOL


@pytest.mark.slow
def test_logprobs_of_the_sharded_weights_equal_one_rank_within_tolerance(run):
    model = tiny_model(seed=1)
    model.load_state_dict(run["micro"]["state"])
    ref = one_rank_trainer("micro", K).model
    rows = batch(9, 0)
    with torch.no_grad():
        a = completion_logprobs(model, rows.prompts, rows.completions, rows.mask, 0)
        b = completion_logprobs(ref, rows.prompts, rows.completions, rows.mask, 0)
    assert float((a - b).abs().max()) <= 1e-4


if __name__ == "__main__":
    import torch.distributed as dist

    code = {"sharded": sharded}[sys.argv[1]](Path(sys.argv[2]))
    dist.destroy_process_group()
    sys.exit(code)
