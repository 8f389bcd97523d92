"""How a peer joins the swarm (:class:`NetConfig`, each field a CLI flag of the daemons) and the housekeeping
its libp2p daemon needs before it starts. Light: importable without starting (or importing) the network
stack, which the CLI's flags rely on."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

# loopback, any free port: safe by default; use /ip4/0.0.0.0/tcp/PORT to be reachable from other machines
DEFAULT_HOST_MADDRS = ("/ip4/127.0.0.1/tcp/0",)


@dataclasses.dataclass(frozen=True)
class NetConfig:
    """How a peer joins the swarm; each field is a CLI flag of the peer daemons.

    bootstrap: multiaddrs (``/ip4/…/tcp/…/p2p/<peer id>``) of peers in the swarm; empty starts one.
    host_maddrs: where to listen; port 0 picks a free port (several peers on one host need no setup).
    announce_maddrs: addresses to advertise instead (a public IP behind port forwarding).
    client_mode: join without serving the DHT (for peers behind NAT that others cannot dial).
    use_relay: allow reaching (and being reached) through libp2p circuit relays.
    use_auto_relay: look for relays and become reachable through them when behind NAT.
    startup_timeout: seconds the libp2p daemon may take to start before we give up and say so.
    identity_path: the libp2p key file, so a restarted peer keeps its peer id (and others' routes to it).
    """

    bootstrap: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = DEFAULT_HOST_MADDRS
    announce_maddrs: tuple[str, ...] = ()
    client_mode: bool = False
    use_relay: bool = True
    use_auto_relay: bool = False
    startup_timeout: float = 30.0
    identity_path: str | None = None  # libp2p key file: the same peer id across restarts (made if missing)

    def __post_init__(self) -> None:
        if self.startup_timeout <= 0:
            raise ValueError("startup_timeout must be positive")
        for m in (*self.bootstrap, *self.host_maddrs, *self.announce_maddrs):
            if not isinstance(m, str) or not m.startswith("/"):
                raise ValueError(
                    f"{m!r} is not a multiaddr (they look like /ip4/1.2.3.4/tcp/31337/p2p/12D3…)"
                )
        for m in self.bootstrap:
            if "/p2p/" not in m:
                raise ValueError(f"bootstrap address {m!r} lacks the /p2p/<peer id> part")


def sweep_stale_sockets(directory: str = "/tmp") -> int:
    """Delete hivemind's unix sockets that nobody listens on any more (left behind by SIGKILLed peers)."""
    import glob
    import socket

    removed = 0
    for path in glob.glob(os.path.join(directory, "hivemind-p2p*.sock")):
        try:
            if os.path.getmtime(path) > time.time() - 60:  # may belong to a peer starting right now
                continue
        except OSError:
            continue
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(0.5)
        try:
            s.connect(path)
        except ConnectionRefusedError:
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed += 1
        except OSError:
            pass  # busy, or not ours to judge
        finally:
            s.close()
    return removed
