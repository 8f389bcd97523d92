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
from collections.abc import Callable
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

__all__ = ["DashboardServer", "prometheus_text"]

PAGE_RESOURCE = ("heterorl.coordinator", "static/dashboard.html")
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
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


# ---- Prometheus text exposition (https://prometheus.io/docs/instrumenting/exposition_formats/) ----


def _escape_label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(x: object) -> str | None:
    """The sample value as Prometheus writes it, or None for anything that is not a number."""
    if isinstance(x, bool):
        return "1" if x else "0"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "+Inf" if x > 0 else "-Inf"
        return repr(x)
    return None


class _Exposition:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(
        self, name: str, kind: str, help_: str, samples: list[tuple[dict[str, object], object]]
    ) -> None:
        self.lines += [f"# HELP {name} {_escape_help(help_)}", f"# TYPE {name} {kind}"]
        for labels, value in samples:
            v = _number(value)
            if v is None:
                continue
            lab = ",".join(f'{k}="{_escape_label(val)}"' for k, val in labels.items())
            self.lines.append(f"{name}{{{lab}}} {v}" if lab else f"{name} {v}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


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
        if _number(v) is not None:
            return v
    versions = [c.get("version") for c in _list(view.get("checkpoints")) if isinstance(c, dict)]
    versions = [v for v in versions if _number(v) is not None]
    return max(versions) if versions else None


def prometheus_text(view: dict) -> str:
    """Render a swarm view (the ``/api/view`` dict) as Prometheus text; missing parts give no samples."""
    learner = _dict(view.get("learner"))
    peers = [p for p in _list(view.get("peers")) if isinstance(p, dict)]
    alive: dict[str, int] = {"learner": 0, "sampler": 0}
    for p in peers:
        role = str(p.get("role", "unknown"))
        alive[role] = alive.get(role, 0) + bool(p.get("alive"))
    last_reward = _last(learner.get("reward_curve"), 1)
    last_sampled = _last(learner.get("eval_curve"), 1)
    last_greedy = _last(learner.get("eval_curve"), 2)

    out = _Exposition()
    out.metric(
        "heterorl_peers_alive",
        "gauge",
        "Peers with a fresh heartbeat, by role.",
        [({"role": r}, n) for r, n in sorted(alive.items())],
    )
    out.metric("heterorl_learner_step", "gauge", "Learner optimizer step.", [({}, learner.get("step"))])
    out.metric(
        "heterorl_learner_reward", "gauge", "Mean reward of the latest learner update.", [({}, last_reward)]
    )
    out.metric(
        "heterorl_learner_eval_sampled",
        "gauge",
        "Expected reward of the learner's policy on held-out prompts, sampled at the run's temperature "
        "(latest evaluation).",
        [({}, last_sampled)],
    )
    out.metric(
        "heterorl_learner_eval_greedy",
        "gauge",
        "Expected reward of the learner's policy on held-out prompts, greedy decoding (latest evaluation).",
        [({}, last_greedy)],
    )
    out.metric(
        "heterorl_batches_accepted_total",
        "counter",
        "Trajectory batches the learner accepted.",
        [({}, learner.get("accepted"))],
    )
    out.metric(
        "heterorl_batches_rejected_total",
        "counter",
        "Trajectory batches the learner rejected (invalid, forged or replayed).",
        [({}, learner.get("rejected"))],
    )
    out.metric(
        "heterorl_checkpoint_version",
        "gauge",
        "Latest published checkpoint version.",
        [({}, _checkpoint_version(view, learner))],
    )
    out.metric(
        "heterorl_peer_tokens_per_second",
        "gauge",
        "Generation or training throughput reported by each peer.",
        [
            ({"peer": p.get("key", ""), "role": p.get("role", "unknown")}, p.get("tokens_per_s"))
            for p in peers
        ],
    )
    out.metric(
        "heterorl_staleness_batches",
        "gauge",
        "Batches the learner used, by staleness bucket (policy versions behind).",
        [({"bucket": b}, n) for b, n in _dict(learner.get("staleness_hist")).items()],
    )
    return out.text()
