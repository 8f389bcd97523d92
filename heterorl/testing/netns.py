"""Several "hosts" on one machine for tests: network namespaces on a private bridge, reached only by address.

``with Lan(["coord", "learner", "s0"]) as lan:`` makes a hub namespace holding a bridge, one namespace per
host with a veth pair into the hub and an address 10.X.0.N/24 (X random per Lan), and loopback up in each.
``lan.wrap(host)`` is the command prefix that runs a process on that host; ``lan.cut(host)`` /
``lan.restore(host)`` take its link down and up; ``lan.shape(host, mbit)`` limits its link to ``mbit``
each way (``tc`` tbf on both ends of its veth pair, each inside a namespace this Lan made: never the
machine's own interfaces). Everything is deleted on exit, even after a failure. Needs root and ``ip``
(iproute2; ``tc`` for shaping).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess

# tc tbf's bucket and queue for a shaped link: 64 KiB bursts (a few frames of a gradient or chunk at a time),
# and at most 200 ms of queue before it drops (these kernels have no netem; tbf is rate and queue only)
SHAPE_BURST = "64kb"
SHAPE_LATENCY = "200ms"


def available() -> str | None:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root for ip netns"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _tc(*args: str) -> str:
    r = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {r.stderr.strip()[:300]}")
    return r.stdout


class Lan:
    def __init__(self, hosts: list[str]):
        self.tag = f"{os.getpid() % 10000}{random.randrange(100):02d}"
        self.subnet = random.randrange(64, 250)
        self.hub = f"hrl{self.tag}hub"
        self.hosts = {h: (f"hrl{self.tag}n{i}", f"10.{self.subnet}.0.{i + 2}") for i, h in enumerate(hosts)}
        self._made: list[str] = []

    def addr(self, host: str) -> str:
        return self.hosts[host][1]

    def wrap(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[host][0]]

    def _hub_if(self, host: str) -> str:
        return f"h{self.tag}{list(self.hosts).index(host)}"

    def _host_if(self, host: str) -> str:
        return f"e{self.tag}{list(self.hosts).index(host)}"

    def cut(self, host: str) -> None:
        _ip("-n", self.hub, "link", "set", self._hub_if(host), "down")

    def restore(self, host: str) -> None:
        _ip("-n", self.hub, "link", "set", self._hub_if(host), "up")

    def shape(self, host: str, mbit: float) -> None:
        """Limit ``host``'s link to ``mbit`` Mbit/s each way: a tbf qdisc on its own end of the veth pair
        (what it sends) and on the hub's end (what it receives), each set inside its namespace."""
        for ns, dev in ((self.hosts[host][0], self._host_if(host)), (self.hub, self._hub_if(host))):
            tbf = ["tbf", "rate", f"{mbit:g}mbit", "burst", SHAPE_BURST, "latency", SHAPE_LATENCY]
            _tc("-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf)

    def qdiscs(self, host: str) -> str:
        """``tc qdisc show`` of both ends of ``host``'s link (to check a shaping)."""
        out = []
        for ns, dev in ((self.hosts[host][0], self._host_if(host)), (self.hub, self._hub_if(host))):
            out.append(_tc("-n", ns, "qdisc", "show", "dev", dev))
        return "".join(out)

    def __enter__(self) -> Lan:
        try:
            _ip("netns", "add", self.hub)
            self._made.append(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for host, (ns, addr) in self.hosts.items():
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                hub_if, host_if = self._hub_if(host), self._host_if(host)
                _ip(
                    "link",
                    "add",
                    host_if,
                    "netns",
                    ns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    hub_if,
                    "netns",
                    self.hub,
                )
                _ip("-n", self.hub, "link", "set", hub_if, "master", "br0")
                _ip("-n", self.hub, "link", "set", hub_if, "up")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", host_if)
                _ip("-n", ns, "link", "set", host_if, "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in reversed(self._made):  # deleting a namespace deletes its end of every veth pair
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                subprocess.run(["kill", "-9", pid], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
