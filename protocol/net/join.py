"""Joining a run: check the bootstrap addresses, start the node, find and verify the RunSpec, pin its key.

What a peer learns is kept in its state directory (``run.json``: run id and pinned coordinator key;
``known_peers.json``: addresses of peers seen; ``runspec.msgpack``: the signed RunSpec it joined as received),
so a restarted peer rejoins the same run, trusts the same key, and can rejoin through peers it met before when
every bootstrap address is down; and tools that read a peer's state offline (``heterorl export``) know which
run, model and learner keys it belongs to.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import socket
import time
from pathlib import Path

from heterorl.protocol import Identity, ProtocolError
from heterorl.protocol.net.config import NetConfig
from heterorl.protocol.net.node import Node, Record
from heterorl.protocol.net.spec import SpecServer, check_run_key, lookup_specs, request_spec
from heterorl.protocol.storage.files import atomic_write, atomic_write_json

log = logging.getLogger(__name__)

MAX_KNOWN_PEERS = 32
RUNSPEC_FILE = "runspec.msgpack"  # in a peer's state dir: the signed RunSpec it joined
ASK_TIMEOUT_S = 30.0  # one DHT lookup or one bootstrap peer's answer, while looking for the RunSpec
ASK_AGAIN_S = 1.0  # the RunSpec is the coordinator's to publish: nothing to wait on but asking again


@dataclasses.dataclass
class Joined:
    node: Node
    spec_raw: bytes
    spec: dict
    run_key: bytes


def _host_port(maddr: str) -> tuple[str, int] | None:
    parts = maddr.strip("/").split("/")
    try:
        i = next(i for i, p in enumerate(parts) if p in ("ip4", "ip6", "dns", "dns4", "dns6"))
        j = parts.index("tcp")
        return parts[i + 1], int(parts[j + 1])
    except (StopIteration, ValueError, IndexError):
        return None


def reachable(maddrs: list[str], timeout: float = 2.0) -> tuple[list[str], list[str]]:
    """Split bootstrap addresses into (answering, failed) with a plain TCP connect to each."""
    ok, failed = [], []
    for m in maddrs:
        hp = _host_port(m)
        if hp is None:
            ok.append(m)  # not TCP (e.g. QUIC): let libp2p try it
            continue
        try:
            with socket.create_connection(hp, timeout=timeout):
                ok.append(m)
        except OSError as e:
            failed.append(m)
            log.warning("bootstrap address %s does not answer: %s", m, e)
    return ok, failed


def known_peers(state_dir: Path) -> list[str]:
    try:
        return [str(m) for m in json.loads((state_dir / "known_peers.json").read_text())][:MAX_KNOWN_PEERS]
    except (OSError, ValueError, TypeError):
        return []


def remember_peers(state_dir: Path, maddrs: list[str]) -> None:
    merged = list(dict.fromkeys([*maddrs, *known_peers(state_dir)]))[:MAX_KNOWN_PEERS]
    atomic_write_json(state_dir / "known_peers.json", merged, indent=1)


def dial_addresses(heartbeats: list[Record], own_key: bytes, per_peer: int = 2) -> list[str]:
    """``/…/p2p/<peer id>`` addresses of the other peers in these Heartbeat records (to rejoin through)."""
    return [
        f"{m}/p2p/{r.body['peer_id']}"
        for r in heartbeats
        if r.kind == "Heartbeat" and r.author != own_key
        for m in r.body["maddrs"][:per_peer]
    ]


def start_node(identity: Identity, config: NetConfig, state_dir: Path, retries: int = 3) -> Node:
    """Start the node through whichever bootstrap (or remembered) addresses answer; say which failed."""
    given = list(config.bootstrap)
    ok, failed = reachable(given)
    if given and not ok:
        remembered = [m for m in known_peers(state_dir) if m not in given]
        ok, _ = reachable(remembered)
        if ok:
            log.warning("no bootstrap address answers; rejoining through %d peer(s) seen before", len(ok))
        else:
            raise RuntimeError(
                f"cannot join: none of the bootstrap addresses answers ({', '.join(failed)}) and no peer "
                "seen before does either"
            )
    cfg = dataclasses.replace(
        config, bootstrap=tuple(ok), identity_path=config.identity_path or str(state_dir / "p2p.key")
    )
    for attempt in range(1, retries + 1):
        try:
            return Node.start(identity, cfg)
        except RuntimeError as e:  # the libp2p daemon did not start in time, or the DHT join failed
            if attempt == retries:
                raise
            log.warning("network start failed (%s); retrying (%d/%d)", e, attempt, retries)
            time.sleep(2.0 * attempt)
    raise AssertionError("unreachable")


def find_spec(
    node: Node, bootstrap: list[str], run_id: str | None, pinned: bytes | None, timeout: float
) -> tuple[bytes, dict, bytes]:
    """The run's RunSpec, from the DHT when the run id is known, else from the bootstrap peers.

    Blocks (one :meth:`Node.call`); TimeoutError when none is found within ``timeout`` seconds."""
    return node.call(
        _find_spec(node, bootstrap, run_id, pinned, timeout), timeout=timeout + 2 * ASK_TIMEOUT_S
    )


async def _find_spec(
    node: Node, bootstrap: list[str], run_id: str | None, pinned: bytes | None, timeout: float
) -> tuple[bytes, dict, bytes]:
    deadline = time.monotonic() + timeout
    said = False
    while True:
        for raw, body, author in await _spec_candidates(node, bootstrap, run_id):
            if run_id and body["run_id"] != run_id:
                continue
            try:
                check_run_key(author, pinned)
            except ProtocolError as e:
                log.warning("refused a RunSpec: %s", e)
                continue
            return raw, body, author
        left = deadline - time.monotonic()
        if left < 0:
            raise TimeoutError(
                f"no RunSpec {'for run ' + run_id + ' ' if run_id else ''}found within {timeout:.0f} s"
            )
        if not said:
            log.info("joining: waiting for the RunSpec%s", f" of run {run_id}" if run_id else "")
            said = True
        await asyncio.sleep(min(ASK_AGAIN_S, left))


async def _spec_candidates(
    node: Node, bootstrap: list[str], run_id: str | None
) -> list[tuple[bytes, dict, bytes]]:
    """Ask the DHT (when the run id is known) and every bootstrap peer at once; the DHT's answers first."""
    asks, what = [], []
    if run_id:
        asks.append(lookup_specs(node, run_id))
        what.append("spec lookup")
    for m in bootstrap:
        if "/p2p/" in m:
            asks.append(request_spec(node, m.split("/p2p/")[-1], (m,)))
            what.append(f"RunSpec from {m}")
    answers = await asyncio.gather(
        *(asyncio.wait_for(a, ASK_TIMEOUT_S) for a in asks), return_exceptions=True
    )
    candidates: list[tuple[bytes, dict, bytes]] = []
    for name, answer in zip(what, answers, strict=True):
        if isinstance(answer, BaseException):  # unreachable, timed out, not a RunSpec: ask again later
            log.debug("%s: %s", name, answer)
        elif isinstance(answer, list):
            candidates += answer
        else:
            candidates.append(answer)
    return candidates


def join(
    identity: Identity,
    config: NetConfig,
    state_dir: Path,
    *,
    run_id: str | None = None,
    run_key: bytes | None = None,
    timeout: float = 120.0,
) -> Joined:
    """Start the node, get the RunSpec (pinned key, or trust on first use, said in the log), serve it too."""
    state_dir.mkdir(parents=True, exist_ok=True)
    saved = {}
    with contextlib.suppress(OSError, ValueError):
        saved = json.loads((state_dir / "run.json").read_text())
    if run_key is None and saved.get("run_key"):
        run_key = bytes.fromhex(saved["run_key"])
    run_id = run_id or saved.get("run_id")
    node = start_node(identity, config, state_dir)
    try:
        raw, body, author = find_spec(node, list(config.bootstrap), run_id, run_key, timeout)
    except BaseException:
        node.close()
        raise
    if run_key is None:
        log.warning(
            "trusting run key %s on first use (run %s); pin it with --run-key %s",
            author.hex()[:16],
            body["run_id"],
            author.hex(),
        )
    else:
        log.info("RunSpec of run %s verified against the pinned key %s", body["run_id"], author.hex()[:16])
    atomic_write_json(state_dir / "run.json", {"run_id": body["run_id"], "run_key": author.hex()}, indent=1)
    atomic_write(state_dir / RUNSPEC_FILE, raw)
    remember_peers(state_dir, list(config.bootstrap))
    node.call(SpecServer(raw).attach(node))
    return Joined(node, raw, body, author)
