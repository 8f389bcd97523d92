"""A swarm of real role processes for tests: coordinator, learner, samplers (honest or hostile), on 127.0.0.1.

Each process has its own state directory under ``root``; :meth:`Swarm.close` kills whatever is left.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.request
from pathlib import Path

from heterorl.localswarm import Proc, ready_line, stop_all


class Swarm:
    def __init__(
        self,
        root: Path,
        model_dir: str | Path,
        *,
        lr: float = 2e-3,
        sampler: dict | None = None,
        extra_toml: str = "",
        learners: int = 1,
        **learner_settings: object,
    ):
        """``sampler``: ``[sampler]`` settings; ``extra_toml``: more run.toml sections (``[adapter]``);
        ``learners``: learner keys in the run (one lineage: ``learner`` holds the lowest, the writer, then
        ``learner-1``...); ``learner_settings``: ``[learner]``."""
        from heterorl.protocol import load_or_create_identity

        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.model_dir = str(Path(model_dir).resolve())
        if learners > 1:
            from heterorl.localswarm.main import learner_dirs_of

            self.learner_dirs = learner_dirs_of(self.root, learners)
        else:
            self.learner_dirs = [self.root / "learner"]
            self.learner_dirs[0].mkdir(exist_ok=True)
        self.learner_dir = self.learner_dirs[0]
        self.learner_keys = [
            load_or_create_identity(d / "peer.key")[0].public_key.hex() for d in self.learner_dirs
        ]
        self.learner_key = self.learner_keys[0]
        self.settings = {"prompts_per_update": 8, "group_size": 8, "publish_every": 1, **learner_settings}
        self.procs: list[Proc] = []
        self.ready: dict = {}
        self.coord: Proc | None = None
        self.lr = lr
        self.sampler_settings = {"prompts_per_batch": 2, **(sampler or {})}
        self.extra_toml = extra_toml

    def run_toml(self, lr: float | None = None) -> Path:
        lr = self.lr if lr is None else lr
        learner = "\n".join(f"{k} = {v}" for k, v in self.settings.items())
        sampler = "\n".join(f"{k} = {v}" for k, v in self.sampler_settings.items())
        path = self.root / "run.toml"
        path.write_text(
            f'run_id = "test-{int(time.time() * 1000) % 10**8}"\n'
            f"learner_keys = {json.dumps(self.learner_keys)}\n"
            f'[model]\npath = "{self.model_dir}"\n[objective]\nname = "gepo"\nlr = {lr}\n'
            f"[learner]\n{learner}\n[sampler]\n{sampler}\n{self.extra_toml}"
        )
        return path

    def start_coordinator(self, *extra: str, wrap: list[str] | None = None) -> dict:
        args = ["coordinator", "--state-dir", str(self.root / "coordinator"), "--dashboard-port", "0"]
        if not (self.root / "coordinator" / "runspec.msgpack").exists():
            args += ["--run-config", str(self.run_toml())]
        self.coord = self._start("coordinator", [*args, *extra], stdout=subprocess.PIPE, wrap=wrap)
        self.ready = ready_line(self.coord, 120)
        return self.ready

    def bootstrap(self) -> list[str]:
        """The flags every peer of this swarm joins with: the coordinator's addresses and key, and the model
        directory the run names (a directory here: each peer is given it, as a volunteer gives its copy)."""
        boot = ["--bootstrap", *self.ready["maddrs"], "--run-key", self.ready["run_key"]]
        return [*boot, "--model-dir", self.model_dir]

    def start_learner(
        self, *extra: str, module: str = "heterorl.cli", wrap: list[str] | None = None, index: int = 0
    ) -> Proc:
        d = self.learner_dirs[index]
        args = ["--role", "learner", "--state-dir", str(d), "--threads", "1"]
        if module == "heterorl.cli":
            args = ["peer", *args]
        return self._start(d.name, [*args, *self.bootstrap(), *extra], module=module, wrap=wrap)

    def sampler_key_for(self, name: str, index: int) -> None:
        """Give sampler ``name`` a key whose first choice of learner (rendezvous hashing) is learner
        ``index``: a test then knows where each sampler's batches go."""
        from heterorl.localswarm.main import key_for_learner

        key_for_learner(self.root / name, [bytes.fromhex(k) for k in self.learner_keys], index)

    def restart_learner(self, learner: Proc, *extra: str, timeout: float = 60, **kw) -> Proc:
        """Stop ``learner`` as a volunteer's Ctrl-C does (SIGTERM: it saves its state and leaves; SIGKILL
        after ``timeout``) and start it again on the same state dir (``extra``, ``kw``: as
        :meth:`start_learner`'s); returns the new process."""
        learner.terminate(timeout)
        if learner in self.procs:
            self.procs.remove(learner)
        return self.start_learner(*extra, **kw)

    def start_sampler(
        self, name: str, *extra: str, module: str = "heterorl.cli", wrap: list[str] | None = None
    ) -> Proc:
        # hf unless a test says otherwise: `--backend auto` would start a vLLM engine for the tiny model,
        # slower to start and to run on it (tests/test_vllm_backend.py covers vLLM samplers)
        backend = [] if "--backend" in extra else ["--backend", "hf"]
        args = ["--state-dir", str(self.root / name), "--threads", "1", *backend, *self.bootstrap(), *extra]
        if module == "heterorl.cli":
            args = ["peer", *args]
        return self._start(name, args, module=module, wrap=wrap)

    def _start(self, name: str, argv: list[str], **kw) -> Proc:
        p = Proc(name, argv, self.root / f"{name}.stderr.log", **kw)
        self.procs.append(p)
        return p

    # ---- what happened ----

    def metrics(self, index: int = 0) -> list[dict]:
        """The learner's updates, one per step (a step replayed after a restart replaces the lost one)."""
        from heterorl.protocol.storage.jsonlog import read_rows

        steps: dict[int, dict] = {}
        for row in read_rows(self.learner_dirs[index] / "metrics.jsonl"):  # a row being written: not yet
            steps[row["step"]] = row
        return [steps[k] for k in sorted(steps)]

    def step(self) -> int:
        m = self.metrics()
        return m[-1]["step"] if m else 0

    def wait_step(self, n: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while self.step() < n:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"learner at step {self.step()}, not {n}, after {timeout:.0f} s\n{self.logs()}"
                )
            time.sleep(0.5)

    def view(self) -> dict:
        with urllib.request.urlopen(self.ready["dashboard"] + "api/view", timeout=10) as r:
            return json.loads(r.read())

    def peer_states(self, names: list[str]) -> dict[str, tuple[str, dict]]:
        """The coordinator's view of the named peers (state dirs under ``root``; those whose key exists yet):
        name -> (state, stats)."""
        from heterorl.protocol import load_or_create_identity

        held = [(n, self.root / n / "peer.key") for n in names]
        keys = {load_or_create_identity(k)[0].public_key.hex()[:8]: n for n, k in held if k.exists()}
        return {keys[p["key"]]: (p["state"], p["stats"]) for p in self.view()["peers"] if p["key"] in keys}

    def logs(self, n: int = 3000) -> str:
        out = []
        for p in self.procs:
            with contextlib.suppress(OSError):
                out.append(f"--- {p.name}\n{p.log_path.read_text()[-n:]}")
        return "\n".join(out)

    def close(self) -> None:
        stop_all(self.procs, timeout=20)
