"""The coordinator's HTTP dashboard: one static page, a JSON API and Prometheus metrics.

Routes: ``GET /`` (the page, ``static/dashboard.html``), ``GET /api/view`` (the swarm view as JSON),
``GET /metrics`` (Prometheus text exposition 0.0.4), ``GET /healthz`` ("ok"); anything else is a 404.
Built on the stdlib :class:`http.server.ThreadingHTTPServer`: no web framework, no TLS, no auth. The view is
public run telemetry; put a reverse proxy in front to serve it beyond localhost with access control.

The server only calls the two callables it is given (``view`` and ``metrics``); it never reaches into the
coordinator. :func:`prometheus_text` renders a view into the exposition format, so the usual wiring is
``DashboardServer(view.snapshot, lambda: prometheus_text(view.snapshot()))``.
"""

from __future__ import annotations

import http.server
import importlib.resources
import json
import logging
import math
import socket
import threading
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

from prometheus_client import exposition
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

log = logging.getLogger(__name__)

__all__ = ["DashboardServer", "prometheus_text"]

PAGE_RESOURCE = ("heterorl.coordinator", "static/dashboard.html")
# generate_latest writes the 0.0.4 text format. Newer prometheus_client names it CONTENT_TYPE_PLAIN_0_0_4
# and means the 1.0.0 format (UTF-8 names) by CONTENT_TYPE_LATEST; older ones have only CONTENT_TYPE_LATEST.
PROMETHEUS_CONTENT_TYPE: str = getattr(exposition, "CONTENT_TYPE_PLAIN_0_0_4", exposition.CONTENT_TYPE_LATEST)
# The page loads nothing from elsewhere; say so, so a browser refuses if it ever tried to.
PAGE_CSP = "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src 'self' data:"
STOP_TIMEOUT_S = 5.0


def _load_page() -> bytes:
    package, name = PAGE_RESOURCE
    return importlib.resources.files(package).joinpath(name).read_bytes()


def _finite(x: object) -> object:
    """``x`` with every NaN/inf float replaced by None (JSON has no NaN; the browser's parser rejects it)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _view_json(view: dict) -> bytes:
    try:
        text = json.dumps(view, allow_nan=False)
    except ValueError:  # a NaN/inf somewhere (e.g. a reward of a diverged run): send it as null
        text = json.dumps(_finite(view), allow_nan=False)
    return text.encode()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "heterorl-dashboard"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = urlsplit(self.path).path
        dash = self.server.dashboard
        try:
            if path in ("/", "/index.html"):
                self._send(200, dash.page, "text/html; charset=utf-8", {"Content-Security-Policy": PAGE_CSP})
            elif path == "/api/view":
                self._send(200, _view_json(dash.view()), "application/json")
            elif path == "/metrics":
                self._send(200, dash.metrics().encode(), PROMETHEUS_CONTENT_TYPE)
            elif path == "/healthz":
                self._send(200, b"ok\n", "text/plain; charset=utf-8")
            else:
                self._send(404, b"not found\n", "text/plain; charset=utf-8")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away; nothing to answer
        except Exception as e:  # a bug in view()/metrics() must not take the dashboard down
            log.exception("dashboard: %s failed", path)
            self._send(500, f"internal error: {type(e).__name__}\n".encode(), "text/plain; charset=utf-8")

    def _send(self, code: int, body: bytes, ctype: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (stdlib signature)
        log.debug("dashboard %s: " + format, self.address_string(), *args)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    dashboard: DashboardServer

    def handle_error(self, request: object, client_address: object) -> None:
        log.debug("dashboard: error serving %s", client_address, exc_info=True)


class DashboardServer:
    """Serves the dashboard page, ``/api/view``, ``/metrics`` and ``/healthz`` from a daemon thread.

    ``view`` returns the swarm view (a JSON-able dict, see ``SwarmView.snapshot``); ``metrics`` returns
    Prometheus text. Both are called from request threads, once per request, so they must be thread-safe.
    The socket is bound on construction (``port=0`` picks a free port; read it from :attr:`port`).
    """

    def __init__(
        self,
        view: Callable[[], dict],
        metrics: Callable[[], str],
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        self.view, self.metrics = view, metrics
        self.page = _load_page()
        server_cls = _Server
        if ":" in host:  # an IPv6 literal such as "::"
            server_cls = type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
        self._httpd = server_cls((host, port), _Handler)
        self._httpd.dashboard = self
        self.host = host
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def start(self) -> DashboardServer:
        """Start serving in a daemon thread; returns self."""
        if self._closed:
            raise RuntimeError("dashboard server is stopped")
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="dashboard", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(STOP_TIMEOUT_S)
        self._httpd.server_close()

    def __enter__(self) -> DashboardServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- Prometheus metrics (https://prometheus.io/docs/instrumenting/exposition_formats/) ----

# Learner figures from its heartbeat's stats: (stat name, counter?, metric name, help). Counters are named
# without ``_total`` (the client adds it); they restart from 0 when the learner does, as counters may.
LEARNER_STATS: tuple[tuple[str, bool, str, str], ...] = (
    (
        "buffer",
        False,
        "heterorl_learner_buffer_batches",
        "Accepted trajectory batches waiting to be trained on.",
    ),
    (
        "wait_frac",
        False,
        "heterorl_learner_wait_ratio",
        "Share of the learner's time spent waiting for batches rather than training, since it started.",
    ),
    (
        "trust/held",
        False,
        "heterorl_learner_trust_held_batches",
        "Accepted batches held until a spot check vouches for their author.",
    ),
    ("trust/banned", False, "heterorl_learner_trust_banned_authors", "Batch authors the learner has banned."),
    (
        "duplicates",
        True,
        "heterorl_learner_duplicate_batches",
        "Trajectory batches the learner received again after taking them once (acknowledged, not reused).",
    ),
    (
        "deferred",
        True,
        "heterorl_learner_deferred_batches",
        "Trajectory batches the learner told their sampler to send again later (buffer full, or admission "
        "deferred).",
    ),
    (
        "publish_failures",
        True,
        "heterorl_learner_publish_failures",
        "Checkpoint announcements to the DHT that failed (each is tried again).",
    ),
    (
        "trust/checked",
        True,
        "heterorl_learner_trust_checked_batches",
        "Trajectory batches the learner's spot checks recomputed.",
    ),
)


def _value(x: object) -> float | None:
    """``x`` as a sample value, or None for anything that is not a number (which gives no sample)."""
    if not isinstance(x, (bool, int, float)):
        return None
    try:
        return float(x)
    except OverflowError:  # an int beyond float's range
        return math.inf if x > 0 else -math.inf


def _dict(x: object) -> dict:
    return x if isinstance(x, dict) else {}


def _list(x: object) -> list:
    return x if isinstance(x, list) else []


def _last(curve: object, i: int) -> object:
    """Field ``i`` of a curve's last point (``[x, y, ...]``), or None."""
    points = _list(curve)
    last = points[-1] if points else None
    return last[i] if isinstance(last, list) and len(last) > i else None


def _checkpoint_version(view: dict, learner: dict) -> object:
    for v in (learner.get("version"), view.get("latest_version")):
        if _value(v) is not None:
            return v
    versions = [c.get("version") for c in _list(view.get("checkpoints")) if isinstance(c, dict)]
    versions = [v for v in versions if _value(v) is not None]
    return max(versions) if versions else None


def _learner_stats(learner: dict, peers: list[dict]) -> dict:
    """The learner's latest heartbeat stats: its peer entry's, over what the view's learner dict holds under
    the same names (``wait_frac``). The view keeps a peer's key to 8 hex digits, so the entry is the learner
    peer with the prefix of the learner's key; none where two share it (one ground to match, say)."""
    key = learner.get("key")
    mine = [
        p for p in peers if isinstance(key, str) and p.get("role") == "learner" and p.get("key") == key[:8]
    ]
    return {**learner, **(_dict(mine[0].get("stats")) if len(mine) == 1 else {})}


def _family(
    name: str,
    help_: str,
    samples: list[tuple[tuple[object, ...], object]],
    labels: tuple[str, ...] = (),
    counter: bool = False,
) -> Metric:
    """One metric family; a sample whose value is not a number is left out."""
    family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, help_, labels=list(labels))
    for label_values, x in samples:
        v = _value(x)
        if v is not None:
            family.add_metric([str(lv) for lv in label_values], v)
    return family


class _ViewCollector:
    """A collector over one swarm view, registered on a registry of its own for one rendering."""

    def __init__(self, view: dict):
        self.view = view

    def collect(self) -> Iterator[Metric]:
        view = self.view
        learner = _dict(view.get("learner"))
        peers = [p for p in _list(view.get("peers")) if isinstance(p, dict)]
        alive: dict[str, int] = {"learner": 0, "sampler": 0}
        for p in peers:
            role = str(p.get("role", "unknown"))
            alive[role] = alive.get(role, 0) + bool(p.get("alive"))
        eval_curve = learner.get("eval_curve")

        yield _family(
            "heterorl_peers_alive",
            "Peers with a fresh heartbeat, by role.",
            [((r,), n) for r, n in sorted(alive.items())],
            ("role",),
        )
        yield _family("heterorl_learner_step", "Learner optimizer step.", [((), learner.get("step"))])
        yield _family(
            "heterorl_learner_reward",
            "Mean reward of the latest learner update.",
            [((), _last(learner.get("reward_curve"), 1))],
        )
        yield _family(
            "heterorl_learner_eval_sampled",
            "Expected reward of the learner's policy on held-out prompts, sampled at the run's temperature "
            "(latest evaluation).",
            [((), _last(eval_curve, 1))],
        )
        yield _family(
            "heterorl_learner_eval_greedy",
            "Expected reward of the learner's policy on held-out prompts, greedy decoding "
            "(latest evaluation).",
            [((), _last(eval_curve, 2))],
        )
        yield _family(
            "heterorl_batches_accepted",
            "Trajectory batches the learner accepted.",
            [((), learner.get("accepted"))],
            counter=True,
        )
        yield _family(
            "heterorl_batches_rejected",
            "Trajectory batches the learner rejected (invalid, forged or replayed).",
            [((), learner.get("rejected"))],
            counter=True,
        )
        yield _family(
            "heterorl_checkpoint_version",
            "Latest published checkpoint version.",
            [((), _checkpoint_version(view, learner))],
        )
        yield _family(
            "heterorl_peer_tokens_per_second",
            "Generation or training throughput reported by each peer.",
            [((p.get("key", ""), p.get("role", "unknown")), p.get("tokens_per_s")) for p in peers],
            ("peer", "role"),
        )
        yield _family(
            "heterorl_staleness_rows",
            "Rows the learner trained on, by staleness band (policy versions behind).",
            [((b,), n) for b, n in _dict(learner.get("staleness_hist")).items()],
            ("bucket",),
        )
        stats = _learner_stats(learner, peers)
        for stat, counter, name, help_ in LEARNER_STATS:
            yield _family(name, help_, [((), stats.get(stat))], counter=counter)


def prometheus_text(view: dict) -> str:
    """Render a swarm view (the ``/api/view`` dict) as Prometheus text; missing parts give no samples."""
    registry = CollectorRegistry()  # one of its own: no global state, no process or GC collectors
    registry.register(_ViewCollector(view))
    return generate_latest(registry).decode()
