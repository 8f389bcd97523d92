"""The network flags every peer command shares, and the NetConfig they make."""

from __future__ import annotations

import argparse

from heterorl.protocol.net.config import DEFAULT_HOST_MADDRS


def add_net_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("network")
    g.add_argument(
        "--bootstrap",
        nargs="*",
        default=[],
        metavar="MADDR",
        help="multiaddrs of peers already in the swarm, /ip4/HOST/tcp/PORT/p2p/PEER_ID (the coordinator "
        "prints them); none starts a new swarm",
    )
    g.add_argument(
        "--host-maddrs",
        nargs="+",
        default=list(DEFAULT_HOST_MADDRS),
        metavar="MADDR",
        help="where to listen; port 0 picks a free port, so several peers share a host without setup; "
        "use /ip4/0.0.0.0/tcp/PORT to be reachable from other machines",
    )
    g.add_argument(
        "--announce-maddrs",
        nargs="*",
        default=[],
        metavar="MADDR",
        help="addresses to advertise instead of the listening ones (a public IP with a forwarded port)",
    )
    g.add_argument(
        "--client-mode",
        action="store_true",
        help="behind NAT or a firewall that others cannot dial: join the DHT as a client (look up and "
        "publish, but do not store others' records); you can still fetch, send and be served through relays",
    )
    g.add_argument(
        "--no-relay",
        dest="use_relay",
        action="store_false",
        help="do not use libp2p circuit relays at all (default: allowed)",
    )
    g.add_argument(
        "--auto-relay",
        dest="use_auto_relay",
        action="store_true",
        help="behind NAT: find relays among the swarm's public peers and become reachable through them",
    )
    g.add_argument("--startup-timeout", type=float, default=30.0, help="seconds the libp2p daemon may take")


def net_config_from_args(args: argparse.Namespace):
    """The NetConfig the flags describe; ValueError (with the bad address) for malformed multiaddrs."""
    from heterorl.protocol.net.config import NetConfig

    return NetConfig(
        bootstrap=tuple(args.bootstrap),
        host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs),
        client_mode=args.client_mode,
        use_relay=args.use_relay,
        use_auto_relay=args.use_auto_relay,
        startup_timeout=args.startup_timeout,
    )
