"""The coordinator's view of the swarm, built only from signed DHT records (heartbeats and manifests).

Anyone can build it (``heterorl status`` does, from any machine); the coordinator keeps its history in
``view.json`` so a restarted coordinator shows the run from where it was. Every series is bounded.
"""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path

from heterorl.protocol.net.dht import checkpoints_key, peers_key
from heterorl.protocol.net.node import Node, Record
from heterorl.protocol.storage.files import atomic_write_json
from heterorl.protocol.wire.messages import unpack_stats
from heterorl.protocol.wire.staleness import STALENESS_BUCKETS

ALIVE_S = 15.0
MAX_POINTS = 2000
MAX_THROUGHPUT_POINTS = 300
MAX_PEERS = 1000


async def fetch_records(node: Node, run_id: str) -> tuple[list[Record], list[Record]]:
    """The run's heartbeat and checkpoint-manifest records, each verified by the node."""
    return await node.lookup(peers_key(run_id)), await node.lookup(checkpoints_key(run_id))


class SwarmView:
    def __init__(self, run_id: str, spec: dict | None = None, path: Path | None = None):
        self.run_id, self.spec, self.path = run_id, spec or {}, path
        self.peers: dict[str, dict] = {}
        self.reward_curve: list[list[float]] = []
        self.ess_curve: list[list[float]] = []
        self.is_var_curve: list[list[float]] = []
        # held-out evaluations of the learner's policy: [step, sampled, greedy] (None where not reported)
        self.eval_curve: list[list[float | None]] = []
        self.throughput: dict[str, collections.deque] = {}
        self.checkpoints: dict[int, dict] = {}
        self.checkpoint_versions: list[list[float]] = []
        self.learner: dict = {}
        self.coordinator: dict = {}
        self.polls = 0
        if path is not None and path.exists():
            self._load(path)

    # ---- persistence ----

    def _load(self, path: Path) -> None:
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        self.peers = d.get("peers", {})
        self.reward_curve = d.get("reward_curve", [])
        self.ess_curve = d.get("ess_curve", [])
        self.is_var_curve = d.get("is_var_curve", [])
        self.eval_curve = d.get("eval_curve", [])  # views saved before evaluations existed lack it
        self.throughput = {
            k: collections.deque(v, MAX_THROUGHPUT_POINTS) for k, v in d.get("throughput", {}).items()
        }
        self.checkpoints = {int(k): v for k, v in d.get("checkpoints", {}).items()}
        self.checkpoint_versions = d.get("checkpoint_versions", [])
        self.learner = d.get("learner", {})

    def save(self) -> None:
        if self.path is None:
            return
        d = {
            "peers": self.peers,
            "reward_curve": self.reward_curve,
            "ess_curve": self.ess_curve,
            "is_var_curve": self.is_var_curve,
            "eval_curve": self.eval_curve,
            "throughput": {k: list(v) for k, v in self.throughput.items()},
            "checkpoints": self.checkpoints,
            "checkpoint_versions": self.checkpoint_versions,
            "learner": self.learner,
        }
        atomic_write_json(self.path, d)

    # ---- polling ----

    def apply(self, heartbeats: list[Record], manifests: list[Record], now: float | None = None) -> None:
        """Fold one look at the DHT (verified records from :func:`fetch_records`) into the view."""
        now = time.time() if now is None else now
        for r in heartbeats:
            if r.kind == "Heartbeat":
                self._heartbeat(r.author.hex(), r.body, now)
        allowed = set(self.spec.get("learner_keys", []))
        for r in manifests:
            if r.kind != "CheckpointManifest" or (allowed and r.author not in allowed):
                continue
            v = r.body["version"]
            if v not in self.checkpoints:
                self.checkpoints[v] = {
                    "version": v,
                    "total_size": r.body["total_size"],
                    "chunks": len(r.body["chunk_hashes"]),
                    "seen_at": now,
                    "learner": r.author.hex()[:16],
                }
                self.checkpoint_versions = [*self.checkpoint_versions, [now, v]][-MAX_POINTS:]
        if len(self.checkpoints) > MAX_POINTS:
            for v in sorted(self.checkpoints)[:-MAX_POINTS]:
                del self.checkpoints[v]
        self.polls += 1

    def _heartbeat(self, key: str, hb: dict, now: float) -> None:
        stats = unpack_stats(hb["stats"])
        prev = self.peers.get(key)
        if prev is not None and prev["timestamp"] >= hb["timestamp"]:
            return
        if prev is None and len(self.peers) >= MAX_PEERS:
            oldest = min(self.peers, key=lambda k: self.peers[k]["timestamp"])
            del self.peers[oldest]
        self.peers[key] = {
            "key": key,
            "role": hb["role"],
            "state": hb["state"],
            "policy_version": hb["policy_version"],
            "tokens_per_s": hb["tokens_per_s"],
            "hardware": hb["hardware"],
            "backend": hb.get("backend", ""),
            "peer_id": hb["peer_id"],
            "timestamp": hb["timestamp"],
            "first_seen": prev["first_seen"] if prev else now,
            "stats": stats,
        }
        series = self.throughput.setdefault(key[:8], collections.deque(maxlen=MAX_THROUGHPUT_POINTS))
        series.append([hb["timestamp"], hb["tokens_per_s"]])
        if hb["role"] == "learner":
            self._learner(key, stats, hb.get("bans", []))

    def _learner(self, key: str, stats: dict, bans: list[dict]) -> None:
        step = int(stats.get("step", 0))
        self._eval(step, stats)
        if self.reward_curve and step <= self.reward_curve[-1][0]:
            if step < self.reward_curve[-1][0]:  # a learner that restarted from an older save
                self.reward_curve = [p for p in self.reward_curve if p[0] < step]
            else:
                return
        if step > 0 and "reward/mean" in stats:
            self.reward_curve = [*self.reward_curve, [step, stats["reward/mean"]]][-MAX_POINTS:]
            if "is/ess" in stats:
                self.ess_curve = [*self.ess_curve, [step, stats["is/ess"]]][-MAX_POINTS:]
            if "is/var" in stats:
                self.is_var_curve = [*self.is_var_curve, [step, stats["is/var"]]][-MAX_POINTS:]
        self.learner = {
            "key": key,
            "step": step,
            "accepted": int(stats.get("accepted", 0)),
            "rejected": int(stats.get("rejected", 0)),
            "wait_frac": stats.get("wait_frac"),
            "staleness_hist": {b: int(stats.get(f"stale:{b}", 0)) for b in STALENESS_BUCKETS},
            "rejected_by": {k[4:]: int(v) for k, v in stats.items() if k.startswith("rej:")},
            # banned authors (hex key) and why, as the learner's last heartbeat names them
            "bans": {b["author"].hex(): b["reason"] for b in bans},
            "checked": int(stats.get("trust/checked", 0)),
        }

    def _eval(self, step: int, stats: dict) -> None:
        """Fold the learner's latest held-out evaluation (``eval/step``, ``eval/sampled``, ``eval/greedy``,
        repeated in every heartbeat until the next one) into ``eval_curve``: one point per evaluation."""
        prev = self.learner.get("step")
        if self.eval_curve and isinstance(prev, int) and step < prev:
            # a learner that restarted from an older save: evaluations past it are of a policy now gone
            self.eval_curve = [p for p in self.eval_curve if p[0] <= step]
        if "eval/step" not in stats:
            return
        at = int(stats["eval/step"])
        sampled, greedy = stats.get("eval/sampled"), stats.get("eval/greedy")
        if sampled is None and greedy is None:
            return
        if self.eval_curve and at <= self.eval_curve[-1][0]:
            if at == self.eval_curve[-1][0]:
                return  # the same evaluation, repeated by a later heartbeat
            self.eval_curve = [p for p in self.eval_curve if p[0] < at]  # restarted from an older save
        self.eval_curve = [*self.eval_curve, [at, sampled, greedy]][-MAX_POINTS:]

    # ---- what the dashboard, /metrics and `heterorl status` show ----

    def _rejected(self, peer: dict, rejected_by: dict[str, int]) -> int:
        n = 0
        for who, count in rejected_by.items():
            if who.startswith("peer:"):
                n += count if peer["peer_id"].startswith(who[5:]) else 0
            elif peer["key"].startswith(who):
                n += count
        return n

    def snapshot(self) -> dict:
        now = time.time()
        rejected_by = self.learner.get("rejected_by", {})
        bans = self.learner.get("bans", {})
        peers = []
        for p in sorted(self.peers.values(), key=lambda p: (p["role"], p["key"])):
            age = now - p["timestamp"]
            peers.append(
                {
                    **{
                        k: p[k]
                        for k in ("role", "state", "policy_version", "tokens_per_s", "hardware", "stats")
                    },
                    "backend": p.get("backend", ""),  # views saved before backends existed lack it
                    "key": p["key"][:8],
                    "peer_id": p["peer_id"],
                    "last_seen_s": round(age, 1),
                    "alive": age < ALIVE_S and p["state"] != "leaving",
                    "rejected": self._rejected(p, rejected_by),
                    "banned": bans.get(p["key"]),  # why the learner banned this peer, or None
                }
            )
        by_author = {}
        for p in peers:
            if p["rejected"]:
                by_author[p["key"]] = p["rejected"]
        latest = max(self.checkpoints) if self.checkpoints else None
        return {
            "run_id": self.run_id,
            "now": now,
            "coordinator": self.coordinator,
            "spec": {
                "model": self.spec.get("model"),
                "task": self.spec.get("task"),
                "objective": self.spec.get("objective"),
                "learner_keys": [k.hex()[:16] for k in self.spec.get("learner_keys", [])],
            },
            "peers": peers,
            "checkpoints": [self.checkpoints[v] for v in sorted(self.checkpoints)[-50:]],
            "latest_version": latest,
            "learner": {
                **self.learner,
                "version": latest,
                "reward_curve": self.reward_curve,
                "ess_curve": self.ess_curve,
                "is_var_curve": self.is_var_curve,
                "eval_curve": self.eval_curve,
                "rejected_by_author": by_author,
            },
            "throughput": {k: list(v) for k, v in self.throughput.items()},
            "checkpoint_versions": self.checkpoint_versions,
        }
