"""``heterorl bench network``'s yardstick (a raw TCP copy on loopback) and its printed table."""

from __future__ import annotations

import socket
import threading
import time


def raw_tcp_copy_s(nbytes: int) -> float:
    """Seconds for one loopback TCP transfer of ``nbytes`` (sender thread → receiver, 1 MiB buffers)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    payload = memoryview(bytes(1 << 20))

    def send() -> None:
        conn, _ = server.accept()
        with conn:
            left = nbytes
            while left > 0:
                n = min(left, len(payload))
                conn.sendall(payload[:n])
                left -= n

    t = threading.Thread(target=send, daemon=True)
    t.start()
    buf = bytearray(1 << 20)
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c:
        got = 0
        while got < nbytes:
            n = c.recv_into(buf)
            if n == 0:
                raise RuntimeError("raw copy: connection closed early")
            got += n
    elapsed = time.perf_counter() - start
    t.join()
    server.close()
    return elapsed


def format_table(results: dict) -> str:
    lines = [
        "| checkpoint | peers | time to all (s) | raw TCP copy (s) | ratio | seeder share |",
        "|---|---|---|---|---|---|",
    ]
    for c in results["checkpoints"]:
        for r in c["propagation"]:
            lines.append(
                f"| {c['size_mb']} MB | {r['peers']} | {r['seconds_to_all']:.2f} | {c['raw_tcp_s']:.3f} | "
                f"{r['ratio_to_raw_copy']:.1f}× | {r['seeder_upload_fraction']:.0%} |"
            )
    lines += [
        "",
        "| checkpoint | full fetch (MiB) | delta fetch, 10% tensors changed (MiB) | fraction |",
        "|---|---|---|---|",
    ]
    for c in results["checkpoints"]:
        d = c["delta"]
        lines.append(
            f"| {c['size_mb']} MB | {d['full_bytes'] / 2**20:.1f} | {d['delta_bytes'] / 2**20:.1f} | "
            f"{d['fraction']:.1%} |"
        )
    dp = results.get("delta_propagation")
    if dp:
        lines += [
            "",
            f"| new version ({dp['size_mb']} MB bf16, delta {dp['delta_size'] / dp['bytes']:.2%}) | peers "
            "| time to all (s) | on the wire (MiB) | seeder upload (MiB) | other peers' upload (MiB) |",
            "|---|---|---|---|---|---|",
        ]
        for mode in ("delta", "full"):
            r = dp[mode]
            lines.append(
                f"| by {mode} | {dp['peers']} | {r['seconds_to_all']:.2f} | "
                f"{r['bytes_on_wire'] / 2**20:.1f} | {r['seeder_upload'] / 2**20:.1f} | "
                f"{r['peer_upload'] / 2**20:.1f} |"
            )
    t = results["trajectories"]
    if t:
        lines += [
            "",
            "| batches | rows × tokens | delivery p50 (ms) | p99 (ms) | Ack round trip p50 (ms) "
            "| wire B/batch | raw B/batch | wire/raw |",
            "|---|---|---|---|---|---|---|---|",
            f"| {t['batches']} | {t['rows']}×{t['tokens_per_row']} | {t['p50_s'] * 1e3:.1f} | "
            f"{t['p99_s'] * 1e3:.1f} | {t['rtt_p50_s'] * 1e3:.1f} | {t['wire_bytes_per_batch']:.0f} | "
            f"{t['raw_payload_bytes']} | {t['wire_to_raw']:.2f}× |",
        ]
    return "\n".join(lines)
