"""The one settings parser: nested sections from TOML-like data, typed values, errors that name the setting,
unknown keys refused (or reported as ignored), overrides from the command line parsed by the same code."""

from __future__ import annotations

import dataclasses

import pytest

from heterorl.protocol.settings.base import setting
from heterorl.protocol.settings.tree import (
    UNSET,
    apply_overrides,
    field_at,
    from_dict,
    parse_assignment,
    parse_assignments,
    paths,
    to_dict,
)

pytestmark = pytest.mark.fast


@dataclasses.dataclass(frozen=True)
class Inner:
    n: int = setting(2, "a count")
    x: float = setting(0.5, "a number")
    names: tuple[str, ...] = setting(("a",), "names")
    cap: float | None = setting(None, "a cap, or none")

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"inner.n must be >= 1, got {self.n}")


@dataclasses.dataclass(frozen=True)
class Extra:
    on: bool = setting(True, "a switch")


@dataclasses.dataclass(frozen=True)
class Tree:
    name: str = setting("t", "a name")
    params: dict = setting(None, "a table", factory=dict)
    inner: Inner = setting(None, "[inner]", factory=Inner)
    extra: Extra | None = setting(None, "[extra], absent: off")


def test_sections_values_and_defaults():
    tree, ignored = from_dict(Tree, {"inner": {"n": 3, "x": 1, "names": ["p", "q"]}, "extra": {}})
    assert tree == Tree(inner=Inner(n=3, x=1.0, names=("p", "q")), extra=Extra())
    assert isinstance(tree.inner.x, float) and ignored == []
    assert from_dict(Tree, {})[0] == Tree()  # every default, written once on its field
    assert from_dict(Tree, {"extra": None})[0].extra is None


@pytest.mark.parametrize(
    "data,match",
    [
        ({"inner": {"n": "3"}}, "inner.n must be an integer"),
        ({"inner": {"n": True}}, "inner.n must be an integer"),
        ({"inner": {"x": "big"}}, "inner.x must be a number"),
        ({"inner": {"names": "p"}}, "inner.names must be a list"),
        ({"inner": {"names": [1]}}, r"inner.names\[0\] must be a string"),
        ({"inner": {"cap": "none"}}, "inner.cap"),
        ({"inner": {"n": 0}}, "inner.n must be >= 1"),  # the class's own check
        ({"inner": 3}, r"\[inner\] must be a table"),
        ({"inner": {"m": 1}}, r"\[inner\]: unknown setting\(s\) m; known: cap, n, names, x"),
        ({"nope": 1}, r"unknown setting\(s\) nope"),
        ({"params": [1]}, "params must be a table"),
        ({"extra": {"on": 1}}, "extra.on must be true or false"),
    ],
)
def test_bad_values_name_the_setting(data, match):
    with pytest.raises(ValueError, match=match):
        from_dict(Tree, data)


def test_unknown_keys_from_a_newer_peer_can_be_ignored_and_are_reported():
    tree, ignored = from_dict(Tree, {"later": 1, "inner": {"n": 4, "new": True}}, strict=False)
    assert tree.inner.n == 4 and ignored == ["later", "inner.new"]


def test_to_dict_round_trips():
    tree = Tree(name="u", params={"k": 1}, inner=Inner(n=5, names=("z",), cap=2.0), extra=Extra(on=False))
    assert from_dict(Tree, to_dict(tree)) == (tree, [])
    assert to_dict(tree)["inner"]["names"] == ["z"]


def test_paths_and_field_lookup():
    assert paths(Tree) == ["name", "params", "inner.n", "inner.x", "inner.names", "inner.cap", "extra.on"]
    assert field_at(Tree, "inner.cap") == (Inner, "cap")
    assert field_at(Tree, "params.anything") == (Tree, "params")  # into a table's keys
    for bad in ("inner", "inner.zz", "zz.n", "name.more", "inner.n.more"):
        with pytest.raises(ValueError, match="unknown setting"):
            field_at(Tree, bad)


def test_overrides_and_assignments_go_through_the_same_parser():
    base = {"inner": {"n": 3}}
    data = apply_overrides(base, {"inner.x": 2, "extra.on": False, "params.k": 7, "name": UNSET})
    assert base == {"inner": {"n": 3}}  # not changed in place
    tree, _ = from_dict(Tree, data)
    assert (tree.inner.n, tree.inner.x, tree.extra, tree.params, tree.name) == (
        3,
        2.0,
        Extra(False),
        {"k": 7},
        "t",
    )
    assert parse_assignment("inner.names=['a', 'b']") == ("inner.names", ["a", "b"])
    assert parse_assignment("name = plain words") == ("name", "plain words")
    assert parse_assignment("inner.cap=2.5") == ("inner.cap", 2.5)
    assert parse_assignments(["inner.n=4", "extra.on=false"], Tree) == {"inner.n": 4, "extra.on": False}
    with pytest.raises(ValueError, match="unknown setting 'inner.q'"):
        parse_assignments(["inner.q=1"], Tree)
    with pytest.raises(ValueError, match="SECTION.KEY=VALUE"):
        parse_assignment("inner.n")
    with pytest.raises(ValueError, match="inner.n must be an integer"):
        from_dict(Tree, apply_overrides({}, dict([parse_assignment("inner.n=four")])))
