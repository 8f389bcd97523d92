"""The documentation stands alone and stays true to the CLI: README.md and docs/*.md.

- README.md is at most 300 lines and names the one-command jobs (``make demo``, ``make test``);
- every relative link between README.md, docs/ and deploy/ points at a file that exists, and every ``#anchor``
  at a heading there (GitHub's anchor rules);
- nothing points at a file outside the repository (``../shared``);
- every ``heterorl ...`` call in a code block or code span uses a command and flags the CLI has (the same
  extraction as deploy/README.md's check in test_deploy_files.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_deploy_files import FLAG, cli_flags, invocations_in_text

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
ALTERNATIVES = re.compile(r"(\w+)(?:\\\|[\w-]+)+")  # `keys new\|show` (a table cell) -> `keys new`
OTHER_TOOLS_FLAGS = {"--gpus", "--network", "--restart", "--stop-timeout", "--init"}  # docker run's
DEEPER = {("model", "import"): (("model", "import", "smollm2"), ("model", "import", "gguf"))}


def _flags(command: tuple[str, ...]) -> frozenset[str] | None:
    """``cli_flags``; for a command nested deeper than the extraction sees, its subcommands' flags."""
    if command in DEEPER:
        return frozenset().union(*(cli_flags(c) or frozenset() for c in DEEPER[command]))
    return cli_flags(command)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    for line in text.splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _code(path: Path) -> tuple[list[str], list[str]]:
    text = ALTERNATIVES.sub(r"\1", path.read_text())
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    spans = re.findall(r"`([^`]+)`", prose.replace("\n", " "))
    return blocks, spans


@pytest.mark.fast
def test_readme_is_short_and_names_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300, "README.md over 300 lines: the rest belongs in docs/"
    assert re.search(r"^make demo\b", text, re.M) and re.search(r"^make test\b", text, re.M)


@pytest.mark.fast
def test_nothing_points_outside_the_repository():
    bad = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in PAGES
        for m in re.finditer(r"\.\./shared|shared/(DESIGN|objectives-spec|STYLE)", p.read_text())
    ]
    assert not bad, bad


@pytest.mark.fast
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page):
    bad = []
    for m in LINK.finditer(page.read_text()):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif not str(dest).startswith(str(ROOT)):
            bad.append(f"{target}: outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: {bad}"


@pytest.mark.slow
def test_documented_commands_use_existing_flags():
    bad, commands, lone = [], set(), set()
    for page in PAGES:
        where = str(page.relative_to(ROOT))
        blocks, spans = _code(page)
        calls = [i for b in blocks for i in invocations_in_text(b, f"{where} code block")]
        calls += [i for s in spans for i in invocations_in_text(s, f"{where} `{s[:40]}`")]
        lone |= {s.split()[0] for s in spans if s.split() and FLAG.fullmatch(s.split()[0])}
        for inv in calls:
            commands.add(inv.command)
            allowed = _flags(inv.command)
            if allowed is None:
                bad.append(f"{inv.where}: there is no command heterorl {' '.join(inv.command)}")
            elif unknown := [f for f in inv.flags if f not in allowed]:
                bad.append(f"{inv.where}: heterorl {' '.join(inv.command)} has no {', '.join(unknown)}")
    assert {("peer",), ("coordinator",), ("local",), ("keys", "new")} <= commands
    assert not bad, "\n".join(bad)
    # a flag named on its own (`--client-mode`) must belong to one of the documented commands
    known = set().union(*(_flags(c) or set() for c in commands | {("simulate",)})) | OTHER_TOOLS_FLAGS
    assert not sorted(lone - known), sorted(lone - known)
