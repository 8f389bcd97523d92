"""Checks of deploy/ that need no Docker daemon and no systemd: the files parse, agree with each other, and
every ``heterorl`` command they run uses only flags that ``heterorl ... --help`` lists, and no
package-index host is written into them (the user names the index; deploy/README.md says which).

Skips are for the machine only: the init-as-root check needs root.
"""

from __future__ import annotations

import configparser
import dataclasses
import fnmatch
import functools
import http.server
import importlib.util
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SCRIPTS = sorted(DEPLOY.glob("*.sh"))
TOP_COMMANDS = ("coordinator", "peer", "status", "local", "keys", "model", "train", "bench", "simulate")
NESTED = ("keys", "model", "bench")  # commands whose first word is a subcommand
FLAG = re.compile(r"--[a-z][a-z0-9-]*")
IMAGE_DEPLOY_DIR = "/opt/heterorl/deploy/"
HEX_KEY = re.compile(r"[0-9a-f]{64}")


# ---- the CLI's flags ----


@functools.cache
def cli_flags(command: tuple[str, ...]) -> frozenset[str] | None:
    """Long flags that ``heterorl COMMAND --help`` lists; None if the command does not exist (yet)."""
    r = subprocess.run(
        [sys.executable, "-m", "heterorl.cli", *command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    if r.returncode != 0:
        if "invalid choice" in r.stderr:
            return None
        raise AssertionError(f"heterorl {' '.join(command)} --help failed:\n{r.stderr}")
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", r.stdout))


@dataclasses.dataclass(frozen=True)
class Invocation:
    where: str
    command: tuple[str, ...]
    flags: tuple[str, ...]


def invocation_from_argv(argv: list[str], where: str) -> Invocation | None:
    """The ``heterorl`` command in an argv (``.../bin/heterorl peer --role ...``), or None."""
    for i, word in enumerate(argv):
        if Path(word).name == "heterorl" and i + 1 < len(argv) and argv[i + 1] in TOP_COMMANDS:
            rest = argv[i + 2 :]
            command = (argv[i + 1],)
            if command[0] in NESTED and rest and not rest[0].startswith("-"):
                command, rest = (command[0], rest[0]), rest[1:]
            flags = tuple(w.split("=", 1)[0] for w in rest if FLAG.fullmatch(w.split("=", 1)[0]))
            return Invocation(where, command, flags)
    return None


_CALL = re.compile(r"(?:^|(?<=[\s/\"'(]))heterorl(?::[\w.-]+)?[ \t]+([a-z][a-z-]*)(?=\s|$)")
_END = re.compile(r"\s#|&&|\|\||[|;)`<>]|\$\(")


def invocations_in_text(text: str, where: str) -> list[Invocation]:
    """``heterorl CMD ...`` calls in shell-like text, also ``docker run ... heterorl:cpu CMD ...``."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        if line.lstrip().startswith("#"):
            continue
        for m in _CALL.finditer(line):
            if m.group(1) not in TOP_COMMANDS:
                continue
            rest = line[m.end() :]
            end = _END.search(rest)
            words = (rest[: end.start()] if end else rest).split()
            inv = invocation_from_argv(["heterorl", m.group(1), *words], where)
            if inv:
                found.append(inv)
    return found


def check_invocations(invocations: list[Invocation]) -> None:
    """Fail on a command or a flag the CLI lacks."""
    assert invocations, "no heterorl command found to check"
    bad = []
    for inv in invocations:
        allowed = cli_flags(inv.command)
        if allowed is None:
            bad.append(f"{inv.where}: there is no command heterorl {' '.join(inv.command)}")
            continue
        unknown = [f for f in inv.flags if f not in allowed]
        if unknown:
            bad.append(f"{inv.where}: heterorl {' '.join(inv.command)} has no {', '.join(unknown)}")
    assert not bad, "\n".join(bad)


def test_text_extraction_finds_commands_and_flags():
    text = (
        "# heterorl peer --comment-only\n"
        'out=$(heterorl keys show --key "$1")\n'
        "docker run -v heterorl-peer:/data heterorl:cpu peer --bootstrap A \\\n  --state-dir /data # --x\n"
        "sudo -u heterorl /opt/heterorl/bin/heterorl model init --out DIR && heterorl train --local\n"
    )
    got = [(i.command, i.flags) for i in invocations_in_text(text, "t")]
    assert got == [
        (("keys", "show"), ("--key",)),
        (("peer",), ("--bootstrap", "--state-dir")),
        (("model", "init"), ("--out",)),
        (("train",), ("--local",)),
    ]


# ---- compose.yaml ----


@pytest.fixture(scope="module")
def compose() -> dict:
    data = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


def _words(value) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def service_argv(svc: dict) -> list[str]:
    if "entrypoint" in svc:  # compose: an entrypoint clears the image's CMD
        return [*_words(svc["entrypoint"]), *_words(svc.get("command"))]
    return ["heterorl", *(_words(svc.get("command")) or ["peer", "--help"])]


def option(argv: list[str], flag: str) -> list[str]:
    """The words after ``flag`` up to the next flag ([] if the flag is absent)."""
    if flag not in argv:
        return []
    out = []
    for w in argv[argv.index(flag) + 1 :]:
        if w.startswith("--"):
            break
        out.append(w)
    return out


def mounts(svc: dict) -> dict[str, tuple[str, bool]]:
    """target -> (named volume or host path, read-only) for a service's short-syntax volumes."""
    out = {}
    for v in svc.get("volumes", []):
        assert isinstance(v, str), f"use the short volume syntax in compose.yaml: {v!r}"
        parts = v.split(":")
        out[parts[1]] = (parts[0], len(parts) > 2 and "ro" in parts[2].split(","))
    return out


def volume_at(svc: dict, path: str) -> tuple[str, bool, str]:
    """(volume, read-only, path inside that volume) of the mount holding ``path`` in a service."""
    best = None
    for target, (source, ro) in mounts(svc).items():
        if (path == target or path.startswith(target.rstrip("/") + "/")) and (
            best is None or len(target) > len(best[0])
        ):
            best = (target, source, ro)
    assert best, f"{path} is on no volume of the service"
    target, source, ro = best
    return source, ro, path[len(target) :].lstrip("/")


def peer_services(compose: dict) -> dict[str, list[str]]:
    out = {}
    for name, svc in compose["services"].items():
        inv = invocation_from_argv(service_argv(svc), name)
        if inv and inv.command == ("peer",):
            out[name] = service_argv(svc)
    return out


def wrapper_flags() -> tuple[str, ...]:
    """The flags wait-for-maddrs.sh appends to the command it runs."""
    text = (DEPLOY / "wait-for-maddrs.sh").read_text()
    flags = tuple(f for group in re.findall(r"extra\+?=\(([^)]*)\)", text) for f in FLAG.findall(group))
    assert "--bootstrap" in flags, "wait-for-maddrs.sh no longer appends --bootstrap"
    return flags


def test_compose_has_the_swarm(compose):
    services = compose["services"]
    assert "coordinator" in services and "learner" in services
    peers = peer_services(compose)
    roles = {name: option(argv, "--role") for name, argv in peers.items()}
    assert roles.get("learner") == ["learner"], roles
    samplers = sorted(n for n, r in roles.items() if r in (["sampler"], []))
    assert len(samplers) == 2, f"want two samplers, found {samplers}"
    coordinator = service_argv(services["coordinator"])
    assert invocation_from_argv(coordinator, "coordinator").command == ("coordinator",)


def test_compose_coordinator_addresses_and_ports(compose):
    svc = compose["services"]["coordinator"]
    argv = service_argv(svc)
    assert option(argv, "--host-maddrs") == ["/ip4/0.0.0.0/tcp/31337"]
    assert option(argv, "--dashboard-host") == ["0.0.0.0"]
    assert option(argv, "--dashboard-port") == ["8470"]
    announce = option(argv, "--announce-maddrs")
    assert announce == ["/dns4/coordinator/tcp/31337"], "announce the compose service name and the DHT port"
    published = {str(p) for p in svc.get("ports", [])}
    assert {"8470:8470", "31337:31337"} <= published, published


def test_compose_files_flow_from_init_to_the_peers(compose):
    services = compose["services"]
    init, coordinator = services["init"], services["coordinator"]
    assert any(w == IMAGE_DEPLOY_DIR + "compose-init.sh" for w in _words(init.get("entrypoint")))
    env = init.get("environment", {})
    assert isinstance(env, dict), "init's environment: use the mapping form"
    assert coordinator["depends_on"]["init"]["condition"] == "service_completed_successfully"

    coord = service_argv(coordinator)
    run_config = option(coord, "--run-config")[0]
    assert run_config == env["HETERORL_SHARED_DIR"].rstrip("/") + "/run.toml"
    assert volume_at(coordinator, run_config)[0] == volume_at(init, run_config)[0]
    assert volume_at(coordinator, run_config)[1] is False, "the coordinator writes its state there"

    coord_key = option(coord, "--key")[0]
    vol, _, inside = volume_at(coordinator, coord_key)
    assert (vol, inside) == volume_at(init, env["HETERORL_COORDINATOR_KEY"])[::2]

    state_dir = option(coord, "--state-dir")[0]
    maddrs = state_dir.rstrip("/") + "/maddrs.txt"
    shared = volume_at(coordinator, maddrs)
    run_key_file = env["HETERORL_SHARED_DIR"].rstrip("/") + "/run-key.hex"
    assert volume_at(init, run_key_file)[0] == shared[0]
    assert volume_at(coordinator, coord_key)[0] != shared[0], "the coordinator's key must not be shared"

    state_volumes = []
    for name, argv in peer_services(compose).items():
        svc = services[name]
        entry = _words(svc.get("entrypoint"))
        assert entry and entry[0] == IMAGE_DEPLOY_DIR + "wait-for-maddrs.sh", name
        assert entry[1] == maddrs, f"{name} waits for {entry[1]}, the coordinator writes {maddrs}"
        assert volume_at(svc, maddrs)[:2] == (shared[0], True), f"{name}: mount the shared volume read-only"
        assert svc["depends_on"]["coordinator"]["condition"] in ("service_started", "service_healthy")
        key_file = svc.get("environment", {}).get("HETERORL_RUN_KEY_FILE")
        assert key_file == run_key_file and volume_at(svc, key_file)[0] == shared[0], name
        assert option(argv, "--host-maddrs") and option(argv, "--host-maddrs")[0].startswith("/ip4/0.0.0.0/")
        peer_state = option(argv, "--state-dir")[0]
        vol, ro, inside = volume_at(svc, peer_state)
        assert not ro, f"{name}: its state dir is read-only"
        assert inside, f"{name}: its state dir (keys, outbox, models) must be on the volume"
        state_volumes.append(vol)
        if name == "learner":
            key = option(argv, "--key")[0] if "--key" in argv else peer_state.rstrip("/") + "/peer.key"
            assert volume_at(svc, key)[::2] == volume_at(init, env["HETERORL_LEARNER_KEY"])[::2], (
                "the learner must use the key init created and listed in run.toml"
            )
    assert len(set(state_volumes)) == len(state_volumes), f"peers share a state volume: {state_volumes}"
    assert shared[0] not in state_volumes


def test_compose_volumes_and_build(compose):
    declared = set(compose.get("volumes") or {})
    for name, svc in compose["services"].items():
        for source, _ in mounts(svc).values():
            if not source.startswith((".", "/", "~")):
                assert source in declared, f"{name} mounts undeclared volume {source}"
        build = svc.get("build")
        if build:
            context = (DEPLOY / build["context"]).resolve()
            assert context == ROOT, f"{name}: the build context must be the repository root"
            assert (context / build["dockerfile"]).is_file()
        assert svc.get("image") or build, name


def test_compose_commands_use_existing_flags(compose):
    invocations = []
    appended = wrapper_flags()
    for name, svc in compose["services"].items():
        argv = service_argv(svc)
        inv = invocation_from_argv(argv, f"compose.yaml:{name}")
        if inv is None:
            continue
        if any(Path(w).name == "wait-for-maddrs.sh" for w in argv):
            inv = dataclasses.replace(inv, flags=inv.flags + appended)
        invocations.append(inv)
    for script in SCRIPTS:
        invocations += invocations_in_text(script.read_text(), script.name)
    check_invocations(invocations)


# ---- the shell scripts ----


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shell_script_parses_and_is_executable(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    assert script.stat().st_mode & stat.S_IXUSR, f"chmod +x {script.name} (compose runs it as entrypoint)"


def test_wait_for_maddrs_appends_bootstrap_and_run_key(tmp_path):
    maddrs = tmp_path / "maddrs.txt"
    maddrs.write_text(
        "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWA\n"
        "\n"
        "/dns4/coordinator/tcp/31337/p2p/12D3KooWA\n"
        "not-an-address\n"
        "/ip4/172.18.0.2/tcp/31337/p2p/12D3KooWA  # comment\n"
    )
    key = tmp_path / "run-key.hex"
    key.write_text("ab" * 32 + "\n")
    env = {**os.environ, "HETERORL_RUN_KEY_FILE": str(key)}
    show_argv = [sys.executable, "-c", "import json, sys; print(json.dumps(sys.argv[1:]))"]
    r = subprocess.run(
        [str(DEPLOY / "wait-for-maddrs.sh"), str(maddrs), "--", *show_argv, "peer", "--role", "sampler"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [
        "peer",
        "--role",
        "sampler",
        "--bootstrap",
        "/dns4/coordinator/tcp/31337/p2p/12D3KooWA",
        "/ip4/172.18.0.2/tcp/31337/p2p/12D3KooWA",
        "--run-key",
        "ab" * 32,
    ]


def test_wait_for_maddrs_gives_up_with_a_message(tmp_path):
    env = {**os.environ, "HETERORL_WAIT_TIMEOUT": "1"}
    missing = tmp_path / "maddrs.txt"
    r = subprocess.run(
        [str(DEPLOY / "wait-for-maddrs.sh"), str(missing), "true"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 1 and str(missing) in r.stderr


def _heterorl_bin() -> Path:
    exe = Path(sys.executable).parent / "heterorl"
    assert exe.exists(), f"no heterorl console script beside {sys.executable} (pip install -e . first)"
    return exe


def test_compose_init_writes_a_run_toml_the_coordinator_accepts(tmp_path):
    exe = _heterorl_bin()
    env = {
        **os.environ,
        "PATH": f"{exe.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "HETERORL_SHARED_DIR": str(tmp_path / "shared"),
        "HETERORL_LEARNER_KEY": str(tmp_path / "learner" / "peer.key"),
        "HETERORL_COORDINATOR_KEY": str(tmp_path / "coordinator" / "coordinator.key"),
        "HETERORL_RUN_ID": "deploy-test",
        "HETERORL_DROP_TO": "",
    }

    def run():
        return subprocess.run(
            [str(DEPLOY / "compose-init.sh")], capture_output=True, text=True, timeout=120, env=env
        )

    r = run()
    assert r.returncode == 0, r.stderr

    def public(key: str) -> str:
        out = subprocess.run(
            [str(exe), "keys", "show", "--key", env[key]], capture_output=True, text=True, check=True
        ).stdout
        return HEX_KEY.search(out).group(0)

    for key in ("HETERORL_LEARNER_KEY", "HETERORL_COORDINATOR_KEY"):
        assert stat.S_IMODE(Path(env[key]).stat().st_mode) == 0o600
    learner, coordinator = public("HETERORL_LEARNER_KEY"), public("HETERORL_COORDINATOR_KEY")
    run_toml = tmp_path / "shared" / "run.toml"
    data = tomllib.loads(run_toml.read_text())
    assert data["run_id"] == "deploy-test" and data["learner_keys"] == [learner]
    assert (tmp_path / "shared" / "run-key.hex").read_text().strip() == coordinator
    assert (tmp_path / "shared" / "coordinator").is_dir()

    from heterorl.protocol.settings import load_run_config

    cfg = load_run_config(run_toml)
    assert cfg.learner_keys == (learner,) and cfg.model.path == "tiny" and cfg.learner.max_staleness == -1

    before = run_toml.read_text()
    r = run()
    assert r.returncode == 0, r.stderr
    assert run_toml.read_text() == before and public("HETERORL_LEARNER_KEY") == learner

    run_toml.write_text(before.replace(learner, "0" * 64))
    r = run()
    assert r.returncode == 1 and learner in r.stderr, "a run.toml without the learner's key must stop init"


FAKE_HETERORL = """#!/bin/bash
# keys new|show --key FILE, like heterorl's, for running compose-init.sh as another user
set -eu
[ "$1" = keys ] && [ "$3" = --key ]
if [ "$2" = new ]; then (umask 077 && head -c 32 /dev/urandom > "$4"); fi
echo "public key: $(sha256sum "$4" | cut -c1-64)"
"""


def test_compose_init_as_root_hands_everything_to_the_user():
    """compose runs init as root (fresh volumes may be root-owned): all it writes must end up the user's."""
    if os.geteuid() != 0:
        pytest.skip("not root: only root can run init as compose does and drop to another user")
    assert shutil.which("setpriv"), "compose-init.sh drops privileges with setpriv (util-linux): install it"
    import pwd
    import tempfile

    nobody = pwd.getpwnam("nobody")  # every Debian/Ubuntu (and the python:3.11-slim image) has it

    root = Path(tempfile.mkdtemp(prefix="heterorl-init-"))  # not under pytest's 0700 tmp dirs
    try:
        root.chmod(0o755)
        (root / "bin").mkdir()
        (root / "bin" / "heterorl").write_text(FAKE_HETERORL)
        shutil.copy(DEPLOY / "compose-init.sh", root / "bin" / "compose-init.sh")
        for f in ("heterorl", "compose-init.sh"):
            (root / "bin" / f).chmod(0o755)
        vols = {name: root / name for name in ("shared", "learner", "coordinator")}
        for v in vols.values():
            v.mkdir()  # like a fresh volume's mount point: root-owned
        env = {
            **os.environ,
            "PATH": f"{root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            "HETERORL_VOLUMES": " ".join(str(v) for v in vols.values()),
            "HETERORL_SHARED_DIR": str(vols["shared"]),
            "HETERORL_LEARNER_KEY": str(vols["learner"] / "peer" / "peer.key"),
            "HETERORL_COORDINATOR_KEY": str(vols["coordinator"] / "coordinator.key"),
            "HETERORL_DROP_TO": "nobody",
        }
        r = subprocess.run(
            [str(root / "bin" / "compose-init.sh")], capture_output=True, text=True, timeout=60, env=env
        )
        assert r.returncode == 0, r.stderr
        written = [p for v in vols.values() for p in (v, *v.rglob("*"))]
        assert {p.stat().st_uid for p in written} == {nobody.pw_uid}, [
            (str(p), p.stat().st_uid) for p in written
        ]
        assert (vols["shared"] / "run.toml").is_file() and (vols["learner"] / "peer" / "peer.key").is_file()
    finally:
        shutil.rmtree(root)


# ---- healthcheck.py ----


def _load_healthcheck():
    spec = importlib.util.spec_from_file_location("deploy_healthcheck", DEPLOY / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_healthcheck_looks_for_p2pd_and_the_url(tmp_path, monkeypatch):
    hc = _load_healthcheck()
    for pid, comm in (("1", "tini"), ("7", "python")):
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "comm").write_text(comm + "\n")
    monkeypatch.setenv("HETERORL_HEALTH_PROC", str(tmp_path))
    monkeypatch.delenv("HETERORL_HEALTH_URL", raising=False)
    assert not hc.p2pd_running(tmp_path) and hc.main() == 1
    (tmp_path / "9").mkdir()
    (tmp_path / "9" / "comm").write_text("p2pd\n")
    assert hc.p2pd_running(tmp_path) and hc.main() == 0

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        monkeypatch.setenv("HETERORL_HEALTH_URL", base + "/metrics")
        assert hc.main() == 0
        monkeypatch.setenv("HETERORL_HEALTH_URL", base + "/nothing")
        assert hc.main() == 1
    finally:
        server.shutdown()
        server.server_close()


# ---- Dockerfiles ----


def dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in (DEPLOY / name).read_text().splitlines():
        if raw.lstrip().startswith("#"):
            continue  # also a comment line inside a continued instruction
        current += raw.rstrip()[:-1] + " " if raw.rstrip().endswith("\\") else raw
        if not raw.rstrip().endswith("\\"):
            if current.strip():
                word, _, rest = current.strip().partition(" ")
                lines.append((word.upper(), rest.strip()))
            current = ""
    return lines


def copy_sources(instructions) -> list[str]:
    out = []
    for word, args in instructions:
        if word == "COPY":
            parts = [p for p in shlex.split(args) if not p.startswith("--")]
            out += parts[:-1]
    return out


DOCKERFILES = ["Dockerfile.cpu", "Dockerfile.cuda"]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_pins_torch_and_installs_the_project(name):
    ins = dockerfile(name)
    assert ins[0][0] == "FROM" and ins[0][1].startswith("python:3.11"), ins[0]
    runs = [args for word, args in ins if word == "RUN"]
    torch_runs = [i for i, r in enumerate(runs) if re.search(r"pip install [^&]*torch==2\.13\.0(\s|$)", r)]
    assert torch_runs, "torch==2.13.0 is not installed pinned"
    project = ".[vllm,tasks]" if name.endswith("cuda") else ".[tasks]"  # a peer can join a reasoning-gym run
    project_runs = [
        i
        for i, r in enumerate(runs)
        if re.search(r"pip install [^&]*--constraint \S+ [\"']?" + re.escape(project) + r"[\"']?(\s|$)", r)
    ]
    assert project_runs, f"no `pip install --constraint FILE {project}`"
    assert torch_runs[0] < project_runs[0], "torch must be installed before the project"
    constraints = re.search(r"--constraint (\S+)", runs[project_runs[0]]).group(1)
    pinned = r"torch==2\.13\.0[^&]*>\s*" + re.escape(constraints)
    assert any(re.search(pinned, r) for r in runs), f"{constraints} must pin torch==2.13.0"
    if name.endswith("cpu"):  # from the index the user names (PyTorch's CPU wheels), and none is no build
        assert '--index-url "$TORCH_INDEX_URL" torch==2.13.0' in runs[torch_runs[0]]
        assert re.match(r'test -n "\$TORCH_INDEX_URL"\s*\|\|', runs[torch_runs[0]]), "say that it is needed"
    else:  # PyPI's CUDA build unless the user names another index
        assert '${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0' in runs[torch_runs[0]]


INDEX_VARIABLES = ("TORCH_INDEX_URL", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL")
LOOPBACK = {"localhost", "127.0.0.1"}
URL_HOST = re.compile(r"\b[a-z][a-z0-9+.-]*://([^/\s:\"'`<>)]+)", re.I)
DOMAIN = re.compile(r"\b(?:[a-z0-9-]+\.)+(?:org|com|net|io|dev|ai|co|cn)\b", re.I)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_takes_package_indexes_from_build_args(name):
    ins = dockerfile(name)
    args = [a for word, a in ins if word == "ARG"]
    for var in INDEX_VARIABLES:
        assert var in args, f"{name}: no `ARG {var}` (without a default: no index host in the repository)"
    first_run = next(i for i, (word, _) in enumerate(ins) if word == "RUN")
    declared = [i for i, (word, a) in enumerate(ins) if word == "ARG" and a in INDEX_VARIABLES]
    assert max(declared) < first_run, "declare the index arguments before the first pip install"


def test_compose_passes_the_package_indexes_from_the_environment(compose):
    for name, svc in compose["services"].items():
        if svc.get("build"):
            args = svc["build"].get("args", {})
            assert args == {v: "${" + v + ":-}" for v in INDEX_VARIABLES}, f"{name}: build args {args}"


def test_no_package_index_host_is_written_into_deploy():
    """Index URLs come from the user's environment; deploy/README.md says in words which index to use."""
    for path in sorted([*DEPLOY.iterdir(), Path(__file__)]):
        if not path.is_file():
            continue
        text = path.read_text()
        # loopback, or a placeholder in capitals (http://COORDINATOR:8470/)
        hosts = {h for h in URL_HOST.findall(text) if h.lower() not in LOOPBACK and not h.isupper()}
        assert not hosts, f"{path.name} names the hosts {sorted(hosts)}"
        if path != Path(__file__):
            assert not DOMAIN.findall(text), f"{path.name} names {DOMAIN.findall(text)}"
    readme = (DEPLOY / "README.md").read_text()
    assert "PyTorch's CPU wheel index" in readme and "TORCH_INDEX_URL" in readme
    for var in INDEX_VARIABLES:
        assert var in readme, f"deploy/README.md does not say what {var} is for"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_user_entrypoint_volume_healthcheck(name):
    ins = dockerfile(name)
    users = [args for word, args in ins if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must end as a non-root user"
    entry = [args for word, args in ins if word == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["heterorl"]
    cmd = [args for word, args in ins if word == "CMD"]
    assert cmd and json.loads(cmd[-1]) == ["peer", "--help"]
    volumes = [v for word, args in ins if word == "VOLUME" for v in json.loads(args)]
    assert "/data" in volumes
    health = [args for word, args in ins if word == "HEALTHCHECK"]
    assert health and "healthcheck.py" in health[-1]
    copied = {Path(s).name for s in copy_sources(ins)}
    assert {"healthcheck.py", "wait-for-maddrs.sh", "compose-init.sh"} <= copied


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_every_package_and_its_ignore_file_keeps_them(name):
    sources = copy_sources(dockerfile(name))
    for s in sources:
        assert (ROOT / s).exists(), f"{name} copies {s}, which does not exist"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {d.split("/")[0] for d in pyproject["tool"]["setuptools"]["package-dir"].values()}
    needed |= {"pyproject.toml", pyproject["project"]["readme"]}
    have = {s.rstrip("/").split("/")[0] for s in sources}
    assert needed <= have, f"{name} does not copy {sorted(needed - have)}: `pip install .` would fail"

    ignore = DEPLOY / f"{name}.dockerignore"
    assert ignore.is_file(), f"BuildKit reads {ignore.name} beside the Dockerfile"
    patterns = [p.strip() for p in ignore.read_text().splitlines() if p.strip() and not p.startswith("#")]
    for must in (".venv", "runs", ".git"):
        assert must in patterns, f"{ignore.name} does not exclude {must}"
    for s in sources:
        for p in patterns:
            assert not fnmatch.fnmatch(s.rstrip("/"), p.lstrip("/")), f"{ignore.name}: {p} drops {s}"


def test_state_dirs_live_in_a_subdirectory_of_the_volume():
    """One volume may hold several peers' state (``/data/peer``, ``/data/learner``): not ``/data``."""
    for path in sorted(DEPLOY.iterdir()):
        if path.is_file():
            text = path.read_text()
            assert not re.search(r"--state-dir[ =]/data(?![\w/])", text), path.name
            assert not re.search(r"(?m)^\s*- /data\s*(#.*)?$", text), f"{path.name}: a bare /data state dir"


# ---- systemd ----


def unit() -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str
    cp.read_string((DEPLOY / "heterorl-peer.service").read_text())
    return cp


def env_example() -> dict[str, str]:
    out = {}
    for line in (DEPLOY / "peer.env.example").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f"peer.env.example: bad line {line!r}"
        out[key] = shlex.split(value)[0] if value.strip() else ""
    return out


def test_systemd_unit_shape_and_hardening():
    u = unit()
    assert {"Unit", "Service", "Install"} <= set(u.sections())
    s = u["Service"]
    argv = shlex.split(s["ExecStart"])
    inv = invocation_from_argv(argv, "ExecStart")
    assert inv and inv.command == ("peer",), "ExecStart must run `heterorl peer`"
    assert Path(argv[0]).is_absolute()
    assert s.get("User") not in (None, "root", "0")
    assert s["EnvironmentFile"] == "/etc/heterorl/peer.env"
    assert s["Restart"] == "on-failure"
    assert s["NoNewPrivileges"] == "yes" and s["ProtectSystem"] == "strict"
    assert s["StateDirectory"] == "heterorl"
    state_dir = option(argv, "--state-dir")
    # under StateDirectory= (the only writable place with ProtectSystem=strict)
    assert state_dir and Path(state_dir[0]).parent == Path("/var/lib/heterorl"), state_dir
    assert s.get("PrivateTmp") == "yes", (
        "ProtectSystem=strict leaves /tmp read-only; p2pd's sockets live there"
    )
    assert s["KillSignal"] == "SIGTERM" and "TimeoutStopSec" in s
    assert u["Install"]["WantedBy"] == "multi-user.target"


def test_systemd_unit_variables_are_in_the_env_example():
    used = set(re.findall(r"(?<!\$)\$\{?([A-Z_][A-Z0-9_]*)", unit()["Service"]["ExecStart"]))
    example = env_example()
    assert "HETERORL_BOOTSTRAP" in used and used <= set(example), used - set(example)
    for maddr in example["HETERORL_BOOTSTRAP"].split():
        assert maddr.startswith("/") and "/p2p/" in maddr


def test_systemd_unit_verifies(tmp_path):
    tool = shutil.which("systemd-analyze")
    assert tool, "systemd-analyze (package systemd) is needed to verify the unit; `make install` installs it"
    text = (DEPLOY / "heterorl-peer.service").read_text()
    exe = shlex.split(unit()["Service"]["ExecStart"])[0]
    (tmp_path / "heterorl-peer.service").write_text(text.replace(exe, "/bin/true"))
    r = subprocess.run(
        [tool, "verify", str(tmp_path / "heterorl-peer.service")], capture_output=True, text=True, timeout=60
    )
    complaints = [
        line
        for line in (r.stdout + r.stderr).splitlines()
        if re.search(r"Unknown (key|section|lvalue)|Failed to parse|Invalid|ignoring", line)
    ]
    assert not complaints, "\n".join(complaints)


def test_systemd_and_env_example_use_existing_flags():
    text = (DEPLOY / "peer.env.example").read_text()
    flags = tuple(sorted(set(FLAG.findall(text))))
    check_invocations(
        [
            invocation_from_argv(shlex.split(unit()["Service"]["ExecStart"]), "heterorl-peer.service"),
            Invocation("peer.env.example", ("peer",), flags),
        ]
    )


# ---- README ----


def readme_code() -> tuple[list[str], list[str]]:
    """(fenced code blocks, inline code spans) of deploy/README.md."""
    text = (DEPLOY / "README.md").read_text()
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    spans = re.findall(r"`([^`]+)`", prose.replace("\n", " "))
    return blocks, spans


def test_readme_commands_use_existing_flags():
    blocks, spans = readme_code()
    invocations = [i for b in blocks for i in invocations_in_text(b, "README.md code block")]
    invocations += [i for s in spans for i in invocations_in_text(s, f"README.md `{s[:40]}`")]
    commands = {i.command for i in invocations}
    assert commands >= {("peer",), ("coordinator",), ("keys", "new")}
    # A flag named on its own (`--client-mode`) must belong to one of the commands the README runs.
    lone = sorted({s.split()[0] for s in spans if FLAG.fullmatch(s.split()[0])})
    helps = [cli_flags(c) for c in commands]
    if all(h is not None for h in helps):
        known = set().union(*helps)
        assert not [f for f in lone if f not in known], [f for f in lone if f not in known]
    check_invocations(invocations)


def test_readme_run_toml_is_a_valid_run_config(tmp_path):
    blocks = re.findall(r"^```toml\n(.*?)^```", (DEPLOY / "README.md").read_text(), re.S | re.M)
    assert len(blocks) == 1, "one run.toml example in deploy/README.md"
    from heterorl.protocol.settings import load_run_config

    path = tmp_path / "run.toml"
    path.write_text(blocks[0].replace("<64 hex chars>", "ab" * 32))
    cfg = load_run_config(path)
    assert cfg.run_id == "my-run" and cfg.learner_keys == ("ab" * 32,)
