"""``is_within``, the containment check of the path rules (workspace, data directory, hidden
paths), compares absolute paths as text: it must answer exactly as pathlib's parts do."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crush_trio.tools.paths import is_within

PARTS = st.sampled_from(["a", "b", "ab", "a.b", "..", ".", "", "/", "//", " ", "a b", "ä"])


def by_parts(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


@pytest.mark.parametrize(
    ("path", "root", "expected"),
    [
        ("/a/b", "/a", True),
        ("/a", "/a", True),
        ("/ab", "/a", False),
        ("/a", "/a/b", False),
        ("/a/b", "/", True),
        ("/", "/", True),
        ("/", "/a", False),
        ("/a/../b", "/a", True),
        ("//a", "//", True),
        ("//", "/", False),
        ("/a", "//", False),
        ("a/b", "a", True),
        ("a", ".", True),
    ],
)
def test_examples(path: str, root: str, expected: bool) -> None:
    assert is_within(Path(path), Path(root)) is expected
    assert by_parts(Path(path), Path(root)) is expected


@given(st.lists(PARTS, max_size=5), st.lists(PARTS, max_size=5), st.booleans(), st.booleans())
def test_same_answer_as_pathlib(
    path_parts: list[str], root_parts: list[str], path_abs: bool, root_abs: bool
) -> None:
    path = Path(("/" if path_abs else "") + "/".join(path_parts))
    root = Path(("/" if root_abs else "") + "/".join(root_parts))
    assert is_within(path, root) == by_parts(path, root)
    # A root that is a prefix of the path's parts.
    prefix = Path(("/" if path_abs else "") + "/".join(path_parts[:2]))
    assert is_within(path, prefix) == by_parts(path, prefix)
