"""``heterorl status --bootstrap MADDR``: the swarm as the DHT shows it, from any machine."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from heterorl.protocol.net.flags import add_net_arguments

    ap.add_argument("--run-id", default=None, help="default: the run the bootstrap peers serve")
    ap.add_argument("--json", action="store_true", help="print the whole view as JSON")
    ap.add_argument("--looks", type=int, default=3, help="DHT lookups merged into the view (default: 3)")
    add_net_arguments(ap)
    ap.set_defaults(client_mode=True)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from heterorl.protocol import Identity
    from heterorl.protocol.net.flags import net_config_from_args
    from heterorl.protocol.net.join import find_spec, start_node

    from .view import SwarmView, fetch_records

    logging.getLogger("hivemind").setLevel(logging.WARNING)
    if not args.bootstrap:
        print("error: --bootstrap MADDR is required (the coordinator prints it)", file=sys.stderr)
        return 2
    config = dataclasses.replace(net_config_from_args(args), client_mode=True)
    try:
        node = start_node(Identity.generate(), config, state_dir=_no_state())
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        _, spec, author = find_spec(node, list(config.bootstrap), args.run_id, None, timeout=30)
        view = SwarmView(spec["run_id"], spec)
        for i in range(args.looks):  # DHT lookups can miss a record that another look finds: merge a few
            if i:
                time.sleep(1.0)
            view.apply(*node.call(fetch_records(node, spec["run_id"]), timeout=30))
        snap = view.snapshot()
    except (TimeoutError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        node.close()
    if args.json:
        print(json.dumps(snap, indent=1))
        return 0
    lr = snap["learner"]
    print(f"run {snap['run_id']}  (coordinator key {author.hex()[:16]}…)")
    print(f"model {spec['model']}  task {spec['task']}  objective {spec['objective']}")
    print(
        f"checkpoint version {snap['latest_version']}  learner step {lr.get('step', '-')}  "
        f"accepted {lr.get('accepted', '-')}  rejected {lr.get('rejected', '-')}"
    )
    print(f"{'role':8s} {'key':8s} {'version':>7s} {'tok/s':>8s} {'seen':>6s}  state")
    for p in snap["peers"]:
        seen = f"{p['last_seen_s']:.0f}s"
        flags = ("" if p["alive"] else "  (gone)") + (f"  REJECTED x{p['rejected']}" if p["rejected"] else "")
        print(
            f"{p['role']:8s} {p['key']:8s} {p['policy_version']:7d} {p['tokens_per_s']:8.0f} {seen:>6s}  "
            f"{p['state']}{flags}"
        )
    return 0


def _no_state():
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp(prefix="heterorl-status-"))
