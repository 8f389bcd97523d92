"""A hostile sampler for tests: a real peer daemon whose batches are wrong on purpose.

``python -m heterorl.testing.hostile --mode MODE <heterorl peer flags>``. Modes:
``wrong-reward`` (claims reward 1 - true), ``forged`` (a signed byte changed after signing),
``other-run`` (batches signed for another run id), ``foreign-prompt`` (prompts not from the run's task).
"""

from __future__ import annotations

import argparse
import sys

import msgpack

from heterorl.peer.daemon import main as peer_main
from heterorl.peer.daemon.sampler import Sampler
from heterorl.protocol import decode, encode

MODES = ("wrong-reward", "forged", "other-run", "foreign-prompt")


def hostile_sampler(mode: str) -> type:
    class Hostile(Sampler):
        def make_batch(self):
            bid, data, tokens = super().make_batch()
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m heterorl.testing.hostile", description=__doc__)
    ap.add_argument("--mode", choices=MODES, required=True)
    peer_main.add_arguments(ap)
    args = ap.parse_args(argv)
    return peer_main.run(args, sampler_class=hostile_sampler(args.mode))


if __name__ == "__main__":
    sys.exit(main())
