"""The import direction that the layout promises, checked on the source (docs/architecture.md, "Layering").

protocol (wire, net, storage, settings) is the bottom layer; peer and coordinator stand on it side by side and
never import each other; heterorl's CLI and tools (cli, local swarm, bench, sim, testing) are on top, and
nothing below imports them. ``heterorl --help`` builds its parser without torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {
    "protocol": "heterorl.protocol",
    "peer": "heterorl.peer",
    "coordinator": "heterorl.coordinator",
}
TOOLS = ("heterorl.cli", "heterorl.localswarm", "heterorl.bench", "heterorl.sim", "heterorl.testing")
FORBIDDEN = {
    "heterorl.protocol": ("heterorl.peer", "heterorl.coordinator", *TOOLS),
    "heterorl.peer": ("heterorl.coordinator", *TOOLS),
    "heterorl.coordinator": ("heterorl.peer", *TOOLS),
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    top = PACKAGE_DIRS.get(rel.parts[0])
    parts = [top] if top else ["heterorl"] if rel.parts[0] == "heterorl" else []
    parts += list(rel.parts[1:-1])
    if path.stem != "__init__":
        parts.append(path.stem)
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports, relative imports resolved, lazy ones included."""
    tree = ast.parse(path.read_text(), str(path))
    here = _module_name(path).split(".")
    package = here if path.stem == "__init__" else here[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


def _violations(layer: str, imported: set[str]) -> list[str]:
    return sorted(i for i in imported for bad in FORBIDDEN[layer] if i == bad or i.startswith(bad + "."))


@pytest.mark.parametrize("folder", sorted(PACKAGE_DIRS))
def test_layers_import_only_downwards(folder):
    layer = PACKAGE_DIRS[folder]
    bad = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        v = _violations(layer, imports_of(path))
        if v:
            bad[str(path.relative_to(ROOT))] = v
    assert not bad, f"{layer} must not import {FORBIDDEN[layer]}: {bad}"


def test_nothing_imports_the_cli_back():
    users = [
        str(p.relative_to(ROOT))
        for folder in ("heterorl", *PACKAGE_DIRS)
        for p in (ROOT / folder).rglob("*.py")
        if p.name not in ("cli.py", "__main__.py")
        and any(i.startswith("heterorl.cli") for i in imports_of(p))
    ]
    assert not users


def test_the_checker_sees_a_violation():
    """The checker itself: a lazy import inside a function, and a relative one, are both found."""
    src = ROOT / "peer" / "daemon" / "_layering_probe.py"
    try:
        src.write_text(
            "def f():\n    from heterorl.coordinator import view\n    from ...coordinator import daemon\n"
        )
        found = imports_of(src)
    finally:
        src.unlink()
    assert {"heterorl.coordinator.view", "heterorl.coordinator.daemon"} <= set(
        _violations("heterorl.peer", found)
    )


def test_help_loads_no_torch():
    heavy = ("torch", "transformers", "vllm", "hivemind", "sympy", "reasoning_gym", "math_verify")
    code = (
        "import sys; from heterorl.cli import build_parser; build_parser(); "
        f"print([m for m in {heavy} if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
