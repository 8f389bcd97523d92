#!/usr/bin/env python3
"""Container health check for the HeteroRL images (``HEALTHCHECK`` in deploy/Dockerfile.*).

Healthy (exit 0) while a go-libp2p daemon (``p2pd``, which every peer and the coordinator run for the DHT)
is alive in the container, and, when ``HETERORL_HEALTH_URL`` is set (deploy/compose.yaml sets the
coordinator's ``http://127.0.0.1:8470/metrics``), while that URL answers 200. Standard library only.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from pathlib import Path


def p2pd_running(proc: str | Path = "/proc") -> bool:
    for comm in Path(proc).glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == "p2pd":
                return True
        except OSError:  # the process ended while we looked
            continue
    return False


def url_ok(url: str, timeout: float = 5.0) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a local URL: never via a proxy
    try:
        with opener.open(url, timeout=timeout) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


def main() -> int:
    if not p2pd_running(os.environ.get("HETERORL_HEALTH_PROC", "/proc")):
        print("unhealthy: no p2pd (the libp2p daemon) is running", file=sys.stderr)
        return 1
    url = os.environ.get("HETERORL_HEALTH_URL")
    if url and not url_ok(url):
        print(f"unhealthy: {url} does not answer 200", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
