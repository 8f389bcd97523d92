"""Several "hosts" on one machine for tests: network namespaces on a private bridge, reached only by address.

``with Lan(["coord", "learner", "s0"]) as lan:`` makes a hub namespace holding a bridge, one namespace per
host with a veth pair into the hub and an address 10.X.0.N/24 (X random per Lan), and loopback up in each.
``lan.wrap(host)`` is the command prefix that runs a process on that host; ``lan.cut(host)`` /
``lan.restore(host)`` take its link down and up. Everything is deleted on exit, even after a failure.
Needs root and ``ip`` (iproute2).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess


def available() -> str | None:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root for ip netns"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


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

    def cut(self, host: str) -> None:
        _ip("-n", self.hub, "link", "set", self._hub_if(host), "down")

    def restore(self, host: str) -> None:
        _ip("-n", self.hub, "link", "set", self._hub_if(host), "up")

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
                hub_if, host_if = self._hub_if(host), f"e{self.tag}{list(self.hosts).index(host)}"
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
