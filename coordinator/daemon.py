"""``heterorl coordinator``: sign the RunSpec, run a bootstrap DHT node, keep the swarm's view, serve the
dashboard, and serve the run's data set (a ``jsonl:PATH`` task: :mod:`.hosting`) from its chunk store.

The run does not depend on it: the RunSpec lives in the DHT and every peer serves it, learners and samplers
talk directly. A restarted coordinator reuses the RunSpec (and run id) and the view kept in its state
directory, and calls the peers it saw before (``known_peers.json``): nobody else would find it on a new port.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from heterorl.protocol.settings import (
    Run,
    RunConfig,
    add_set_flag,
    check_learner_keys,
    load_run_config,
    overrides_of,
)
from heterorl.protocol.storage.files import atomic_write
from heterorl.protocol.wire.dataset import MAX_DATASET_BYTES

if TYPE_CHECKING:  # imported where used: `heterorl --help` loads this module, and no network code
    from heterorl.protocol.storage.store import ChunkStore

    from .hosting import CheckDataset

log = logging.getLogger("heterorl.coordinator")

SPEC_REPUBLISH_S = 3600.0
REJOIN_EVERY_S = 5.0  # how often a coordinator that knows no DHT peer calls the peers it saw before
STORE_BYTES = 2 * MAX_DATASET_BYTES  # its chunk store holds the run's data set and nothing else


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from heterorl.protocol.net.flags import add_net_arguments

    ap.add_argument(
        "--run-config", default=None, help="run.toml (needed on first start; see --example-config)"
    )
    add_set_flag(ap, RunConfig)  # over --run-config's settings
    ap.add_argument("--example-config", action="store_true", help="print an example run.toml and exit")
    ap.add_argument(
        "--state-dir", default="~/.heterorl/coordinator", help="RunSpec, key, view (default: %(default)s)"
    )
    ap.add_argument("--key", default=None, help="coordinator key file (default: STATE_DIR/coordinator.key)")
    ap.add_argument("--dashboard-host", default="127.0.0.1", help="0.0.0.0 to serve the dashboard to others")
    ap.add_argument(
        "--dashboard-port", type=int, default=8470, help="0 picks a free port (default: %(default)s)"
    )
    ap.add_argument("--poll-s", type=float, default=1.0, help="seconds between looks at the DHT")
    ap.add_argument("--log-level", default="INFO")
    add_net_arguments(ap)


# (run config, model cache dir) -> (initial checkpoint hash, vocab size, base hash of an adapter run): loads
# the model once. The peer side implements it (heterorl.peer.daemon.weights.initial_state); the CLI passes it
# in, so the coordinator needs no torch of its own.
InitialState = Callable[[Run, Path], "tuple[bytes, int, bytes | None]"]


def _sign_spec(
    args: argparse.Namespace,
    state_dir: Path,
    identity,
    initial_state: InitialState,
    store: ChunkStore,
    check_dataset: CheckDataset,
) -> bytes:
    """The stored RunSpec, or a new one signed from --run-config (model loaded once for its hash, a jsonl
    data set put into ``store`` and named by its id: :func:`.hosting.host_files`)."""
    from heterorl.protocol import decode, encode

    stored = state_dir / "runspec.msgpack"
    if stored.exists():
        raw = stored.read_bytes()
        _, body, author = decode(raw, "RunSpec")
        if author != identity.public_key:
            raise ValueError(f"{stored} was signed by another key than {args.key or 'this coordinator'}'s")
        try:  # signed before runs were held to one learner: not served again
            check_learner_keys(body["learner_keys"])
        except ValueError as e:
            raise ValueError(f"{stored}: {e}; start a new run (a new --state-dir)") from None
        log.info("resuming run %s with its stored RunSpec (%s)", body["run_id"], stored)
        if args.run_config or overrides_of(args):
            log.info(
                "--run-config and --set ignored: a run's spec does not change; use a new --state-dir for a "
                "new run"
            )
        return raw
    if not args.run_config:
        raise ValueError("first start needs --run-config run.toml (heterorl coordinator --example-config)")
    from .hosting import host_files

    cfg = host_files(load_run_config(args.run_config, overrides_of(args)), store, check_dataset)
    initial, vocab_size, base = initial_state(cfg, state_dir / "models")
    body = cfg.runspec_body(initial, vocab_size, base_hash=base)
    raw = encode("RunSpec", body, identity)
    atomic_write(stored, raw)
    log.info(
        "new run %s: model %s, task %s, objective %s",
        cfg.run_id,
        cfg.model.path,
        cfg.task.name,
        cfg.objective.name,
    )
    if cfg.adapter is not None:
        log.info("adapter run: LoRA %s on base sha256 %s", cfg.adapter, base.hex())
    return raw


def run(args: argparse.Namespace, initial_state: InitialState, check_dataset: CheckDataset) -> int:
    """Host the run until SIGTERM/SIGINT; ``initial_state`` hashes the model for a new RunSpec,
    ``check_dataset`` checks that a jsonl data set parses as its task."""
    if args.example_config:
        from heterorl.protocol.settings import EXAMPLE

        print(EXAMPLE, end="")
        return 0
    from heterorl.protocol import decode, load_or_create_identity
    from heterorl.protocol.logs import configure_logging
    from heterorl.protocol.net.flags import net_config_from_args
    from heterorl.protocol.net.node import Node
    from heterorl.protocol.net.spec import SpecServer
    from heterorl.protocol.signals import install_stop_signals

    from .dashboard import DashboardServer, prometheus_text
    from .view import SwarmView

    state_dir = Path(args.state_dir).expanduser()
    state_dir.mkdir(parents=True, exist_ok=True)
    configure_logging(args.log_level, state_dir / "coordinator.log")
    try:
        from heterorl.protocol.storage.store import ChunkStore

        identity, _ = load_or_create_identity(args.key or state_dir / "coordinator.key")
        store = ChunkStore(state_dir / "chunks", max_bytes=STORE_BYTES)
        raw = _sign_spec(args, state_dir, identity, initial_state, store, check_dataset)
        config = net_config_from_args(args)
        # the same libp2p peer id after a restart: with a fixed port, peers' bootstrap addresses stay valid
        config = dataclasses.replace(config, identity_path=str(state_dir / "p2p.key"))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _, spec, _ = decode(raw, "RunSpec")
    stop = threading.Event()
    install_stop_signals(stop.set, log)  # the handler takes no lock; a second signal leaves at once
    try:
        node = Node.start(identity, config)
    except RuntimeError as e:
        log.error("%s", e)
        return 1
    view = SwarmView(spec["run_id"], spec, state_dir / "view.json")
    lock = threading.Lock()
    try:
        node.call(SpecServer(raw).attach(node))
        _serve_dataset(node, store, spec)
        node.call(node.addresses(), timeout=30)  # asks the daemon again if they were not known at start
        maddrs = node.maddrs  # peers bootstrap through these (maddrs.txt): never written empty
        view.coordinator = {"peer_id": node.peer_id, "maddrs": maddrs, "started_at": time.time()}
        atomic_write(state_dir / "maddrs.txt", "\n".join(maddrs) + "\n")
        dash = DashboardServer(
            lambda: _locked(lock, view.snapshot),
            lambda: prometheus_text(_locked(lock, view.snapshot)),
            args.dashboard_host,
            args.dashboard_port,
        )
        dash.start()
        print(
            json.dumps(
                {
                    "event": "ready",
                    "run_id": spec["run_id"],
                    "run_key": identity.public_key.hex(),
                    "maddrs": maddrs,
                    "dashboard": dash.url,
                }
            ),
            flush=True,
        )
        log.info("run %s; coordinator key %s", spec["run_id"], identity.public_key.hex())
        log.info("peers join with: heterorl peer --bootstrap %s", " ".join(maddrs))
        log.info("dashboard at %s (metrics at %smetrics)", dash.url, dash.url)
        _serve(node, raw, view, lock, stop, args.poll_s, state_dir)
    finally:
        with lock:
            view.save()
        node.close()
    log.info("coordinator stopped; the run goes on without it")
    return 0


def _serve_dataset(node, store: ChunkStore, spec: dict) -> None:
    """Serve the chunk store and, for a run with a data set, announce this node as its provider (a task the
    node owns: cancelled when it closes)."""
    from heterorl.protocol.net.chunks import ChunkServer
    from heterorl.protocol.net.datasets import held_dataset, keep_announced
    from heterorl.protocol.settings import RunSettings
    from heterorl.protocol.wire.dataset import dataset_id_of

    node.call(ChunkServer(store).attach(node))
    try:
        task = RunSettings.from_spec(spec).task
        dataset_id = dataset_id_of(task.name, task.params)
    except ValueError as e:  # a spec this coordinator signed, so not expected; the run may go on without it
        log.warning("no data set served: %s", e)
        return
    if dataset_id is None:
        return
    if held_dataset(store, dataset_id) is None:
        log.warning(
            "the run's data set %s is not whole in %s: peers can only fetch it from each other",
            dataset_id.hex(),
            store.root,
        )
        return
    node.spawn(keep_announced(node, spec["run_id"], dataset_id))
    log.info("serving the run's data set %s", dataset_id.hex())


def _locked(lock: threading.Lock, fn):
    with lock:
        return fn()


def _serve(
    node, raw: bytes, view, lock: threading.Lock, stop: threading.Event, poll_s: float, state_dir: Path
) -> None:
    from heterorl.protocol.net.join import dial_addresses, known_peers, remember_peers

    from .view import fetch_records

    published_at = 0.0
    saved_at = time.monotonic()
    rejoined_at = -REJOIN_EVERY_S
    remembered: set[str] = set()
    lonely = False
    while not stop.is_set():
        if node.known_dht_peers() == 0 and time.monotonic() - rejoined_at > REJOIN_EVERY_S:
            # a restart (on a new port, or after an outage) leaves us knowing nobody: nobody would call us
            rejoined_at = time.monotonic()
            known = known_peers(state_dir)
            if known:
                try:
                    n = node.call(node.rejoin(known), timeout=60)
                except Exception as e:
                    n = 0
                    log.debug("rejoin failed: %s", e)
                if n:
                    log.info("rejoined the swarm through %d of %d peer(s) seen before", n, len(known))
                elif not lonely:  # said once, not every few seconds while alone
                    log.warning("none of the %d peer(s) seen before answers; waiting for peers", len(known))
                lonely = not n
        if time.monotonic() - published_at > SPEC_REPUBLISH_S or not published_at:
            try:
                if node.call(node.publish_message(raw), timeout=30):
                    published_at = time.monotonic()
            except Exception as e:
                log.warning("RunSpec not (re)published in the DHT: %s", e)
        try:
            records = node.call(fetch_records(node, view.run_id), timeout=30)
            with lock:
                view.apply(*records)
            seen = dial_addresses(records[0], node.identity.public_key)
            if not set(seen) <= remembered:  # so that a restarted coordinator can call them
                remember_peers(state_dir, seen)
                remembered.update(seen)
        except Exception as e:
            log.warning("view not refreshed: %s", e)
        if time.monotonic() - saved_at > 5:
            with lock:
                view.save()
            saved_at = time.monotonic()
        stop.wait(poll_s)
