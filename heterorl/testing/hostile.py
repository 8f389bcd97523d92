"""Hostile peers for tests: real peer daemons that are wrong on purpose.

``python -m heterorl.testing.hostile --mode MODE <heterorl peer flags>``. Sampler modes (``--role sampler``):
``wrong-reward`` (claims reward 1 - true), ``forged`` (a signed byte changed after signing),
``other-run`` (batches signed for another run id), ``foreign-prompt`` (prompts not from the run's task),
``broken-sender`` (not hostile, faulty: its trajectory sender dies of a disk error after its first
acknowledged batch). Learner mode (``--role learner``, with a key the run lists): ``wrong-initial``
(publishes, signed, a version 0 whose weights differ from the RunSpec's initial checkpoint).

``--attack NAME`` (or ``module:function``) instead runs a sampler changed by an attack function
(:mod:`.attacks`: forged log-probs, text from another model, a backdoor phrase, a wrong temperature, a stale
version claim, replayed rows, quantised weights, one foreign row per batch, a sleeper, a flood of fresh
identities). Its ``final_stats.json`` lists the batches it sent that the attack changed
(``hostile_batch_ids``, ``hostile_batches_sent``).
"""

from __future__ import annotations

import argparse
import sqlite3
import sys

import msgpack
import torch

from heterorl.peer.daemon import main as peer_main
from heterorl.peer.daemon.sampler import Sampler
from heterorl.protocol import decode, encode
from heterorl.protocol.net.trajectories import TrajectorySender

SAMPLER_MODES = ("wrong-reward", "forged", "other-run", "foreign-prompt", "broken-sender")
BROKEN_SENDER_ERROR = "disk I/O error (broken-sender: after its first acknowledged batch)"
LEARNER_MODES = ("wrong-initial",)
MODES = SAMPLER_MODES + LEARNER_MODES


class BrokenSender(TrajectorySender):
    """A sender that fails (as on a failing disk) once a learner acknowledged one of its batches."""

    async def send_due(self) -> int:
        acked = await super().send_due()
        if self.acked:
            raise sqlite3.OperationalError(BROKEN_SENDER_ERROR)
        return acked


class BrokenSenderSampler(Sampler):
    SENDER = BrokenSender


def hostile_sampler(mode: str) -> type:
    if mode == "broken-sender":
        return BrokenSenderSampler

    class Hostile(Sampler):
        def sign_batch(self, rows, **kw):
            bid, data, tokens = super().sign_batch(rows, **kw)
            _, body, _ = decode(data)
            if mode == "wrong-reward":
                for r in body["rows"]:
                    r["reward"] = 1.0 - r["reward"]
                return bid, encode("TrajectoryBatch", body, self.identity), tokens
            if mode == "other-run":
                other = {**body, "run_id": "another-run"}
                return bid, encode("TrajectoryBatch", other, self.identity), tokens
            if mode == "foreign-prompt":
                for r in body["rows"]:
                    r["prompt_ids"] = self.tok.encode("hello?", add_special_tokens=False)
                return bid, encode("TrajectoryBatch", body, self.identity), tokens
            env = msgpack.unpackb(data, raw=False)  # forged: change a claimed reward after signing
            env["body"]["rows"][0]["reward"] = 1.0 - env["body"]["rows"][0]["reward"]
            return bid, msgpack.packb(env, use_bin_type=True), tokens

    return Hostile


def hostile_learner(mode: str) -> type:
    from heterorl.peer.daemon.learner import Learner

    class Hostile(Learner):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)  # checks our weights against the RunSpec's hash
            if mode == "wrong-initial" and self.step == 0:
                with torch.no_grad():  # then changes them: version 0 is published signed, but not the spec's
                    next(self.trainer.model.parameters()).add_(0.01)

    return Hostile


def attacked_sampler(spec: str) -> type:
    """A Sampler that ``attack(self)`` changes once it is made (:func:`.attacks.load_attack`). Its final
    stats add the batches the attack recorded as hostile (``sampler.hostile_batch_ids``; every batch it makes
    for an attack that records none): ``hostile_batch_ids`` (hex), ``hostile_batches_signed`` and
    ``hostile_batches_sent`` (signed and no longer queued in its outbox: the learner answered them)."""
    from .attacks import every_batch_hostile, load_attack

    attack = load_attack(spec)

    class Attacked(Sampler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.hostile_batch_ids: set[str] | None = None
            attack(self)
            if self.hostile_batch_ids is None:  # an attack that keeps no record: all it makes is hostile
                every_batch_hostile(self)

        def hostile_stats(self) -> dict:
            ids = sorted(self.hostile_batch_ids or ())
            queued = _queued_ids(self.state_dir / "outbox.sqlite")
            return {
                "hostile_batch_ids": ids,
                "hostile_batches_signed": len(ids),
                "hostile_batches_sent": sum(i not in queued for i in ids),
            }

        def _write_final_stats(self) -> None:
            write = self.rt.write_final_stats
            self.rt.write_final_stats = lambda stats: write({**stats, **self.hostile_stats()})
            try:
                super()._write_final_stats()
            finally:
                self.rt.write_final_stats = write

    return Attacked


def _queued_ids(path) -> set[str]:
    """Hex ids of the batches still queued in the outbox at ``path`` (read on a connection of its own)."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            return {bytes(b).hex() for (b,) in conn.execute("SELECT batch_id FROM items")}
        finally:
            conn.close()
    except sqlite3.Error:
        return set()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m heterorl.testing.hostile", description=__doc__)
    how = ap.add_mutually_exclusive_group(required=True)
    how.add_argument("--mode", choices=MODES)
    how.add_argument("--attack", metavar="NAME|MODULE:FUNCTION", help="a sampler changed by this attack")
    peer_main.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.attack:
        if args.role != "sampler":
            ap.error("--attack is for samplers")
        return peer_main.run(args, peer_class=attacked_sampler(args.attack))
    role_modes = SAMPLER_MODES if args.role == "sampler" else LEARNER_MODES
    if args.mode not in role_modes:
        ap.error(f"--mode {args.mode} is not a {args.role} mode ({', '.join(role_modes)})")
    make = hostile_sampler if args.role == "sampler" else hostile_learner
    return peer_main.run(args, peer_class=make(args.mode))


if __name__ == "__main__":
    sys.exit(main())
