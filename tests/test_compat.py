"""The adapters to dependencies' internals (crush_trio/_compat/) and the rule they keep.

Each adapter checks, when imported, the private names it relies on; these tests assert that the
check passes on the pinned versions, that the pins are the versions the adapter names, and that a
simulated upgrade (a name gone, a changed signature) raises a clear CompatError rather than
letting the code fall back silently. The last tests scan the source tree for private imports
and private names of dependencies outside crush_trio/_compat/.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import tomllib
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

import httpcore
import pytest
from hypercorn.trio import tcp_server

from crush_trio._compat import CompatError
from crush_trio._compat import httpcore as httpcore_compat
from crush_trio._compat import hypercorn as hypercorn_compat

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "crush_trio"
COMPAT = PACKAGE / "_compat"


def pinned() -> dict[str, str]:
    """The exact pins (``name==version``) of pyproject.toml's dependencies."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins: dict[str, str] = {}
    for requirement in project["dependencies"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9][A-Za-z0-9.]*)", requirement)
        if match:
            pins[match[1].lower()] = match[2]
    return pins


def load_fresh(module: ModuleType) -> None:
    """Import ``module``'s file again under another name (runs its import-time check)."""
    assert module.__file__ is not None
    spec = importlib.util.spec_from_file_location("crush_trio._compat.probe", module.__file__)
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


@pytest.mark.parametrize("adapter", [httpcore_compat, hypercorn_compat], ids=lambda m: m.__name__)
def test_an_adapter_names_the_pinned_versions_and_they_are_installed(adapter: Any) -> None:
    pins = pinned()
    for name, version in adapter.CHECKED_AGAINST.items():
        assert pins.get(name) == version, f"pyproject.toml must pin {name}=={version}"
        assert metadata.version(name) == version
    adapter.check()


def test_the_httpcore_check_fails_loudly_when_a_wrapper_stops_holding_its_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from httpcore._async.connection_pool import PoolByteStream

    def renamed(self: Any, stream: Any, pool_request: Any, pool: Any) -> None:
        self._inner = stream  # an upgrade that renamed the attribute

    monkeypatch.setattr(PoolByteStream, "__init__", renamed)
    with pytest.raises(CompatError) as info:
        httpcore_compat.check()
    message = str(info.value)
    assert "PoolByteStream._stream no longer holds the wrapped object" in message
    assert "checked against httpx 0.28.1, httpcore 1.0.9, h11 0.16.0" in message


def test_the_httpcore_check_fails_loudly_when_the_h11_state_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = httpcore.AsyncHTTP11Connection.__init__

    def without_state(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        del self._h11_state

    monkeypatch.setattr(httpcore.AsyncHTTP11Connection, "__init__", without_state)
    with pytest.raises(CompatError, match="_h11_state is no longer"):
        httpcore_compat.check()


def test_importing_the_httpcore_adapter_fails_loudly_when_a_private_module_lost_a_class(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from httpcore._async import http11

    monkeypatch.delattr(http11, "HTTP11ConnectionByteStream")
    with pytest.raises(CompatError, match="a private stream wrapper is gone"):
        load_fresh(httpcore_compat)


def test_the_httpcore_adapter_finds_nothing_behind_a_stream_it_does_not_know() -> None:
    assert httpcore_compat.http11_exchange(object()) is None


def test_a_finished_exchange_is_what_h11_reaches_after_a_whole_response() -> None:
    import h11

    state = httpcore_compat.finished_exchange()
    assert (state.our_state, state.their_state) == (h11.DONE, h11.DONE)
    state.start_next_cycle()  # what httpcore does to reuse the connection
    assert (state.our_state, state.their_state) == (h11.IDLE, h11.IDLE)


def test_the_hypercorn_check_fails_loudly_when_a_hooked_method_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(tcp_server.TCPServer, "_close")
    with pytest.raises(CompatError) as info:
        hypercorn_compat.check()
    message = str(info.value)
    assert "TCPServer._close is gone" in message
    assert "checked against hypercorn 0.18.0" in message


def test_the_hypercorn_check_fails_loudly_when_a_hooked_method_changes_signature(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def read_data(self: Any, limit: int) -> None:
        pass

    monkeypatch.setattr(tcp_server.TCPServer, "_read_data", read_data)
    with pytest.raises(CompatError, match=r"_read_data now takes \('limit',\)"):
        hypercorn_compat.check()


def test_the_hypercorn_check_fails_loudly_when_run_stops_calling_a_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def run(self: Any) -> None:
        await self._read_everything()

    monkeypatch.setattr(tcp_server.TCPServer, "run", run)
    with pytest.raises(CompatError, match="run no longer calls"):
        hypercorn_compat.check()


def test_the_listener_overrides_the_hooks_not_the_private_methods() -> None:
    from crush_trio.server.listener import HttpConnection

    assert issubclass(HttpConnection, hypercorn_compat.HypercornConnection)
    assert "read_data" in vars(HttpConnection) and "close_connection" in vars(HttpConnection)
    assert "_read_data" not in vars(HttpConnection) and "_close" not in vars(HttpConnection)


# ---------------------------------------------------------------------------------------------
# The rule, over the source tree

#: Modules that still touch dependency internals outside crush_trio/_compat/, with what they
#: touch: to move into _compat/trio_websocket.py and _compat/wsproto.py.
KNOWN_EXCEPTIONS = {
    "crush_trio/wsdeflate.py",
    "crush_trio/server/ws_trio.py",
    "crush_trio/client/transport.py",
}

#: Private names of dependencies that only their adapter may use.
ADAPTED_NAMES = re.compile(
    r"\b(_h11_state|_httpcore_stream|_httpx_utils|_read_data|HTTP11ConnectionByteStream"
    r"|PoolByteStream|BoundAsyncStream|AsyncResponseStream|hypercorn\.trio\.tcp_server"
    r"|hypercorn\.trio\.lifespan|hypercorn\.trio\.worker_context|hypercorn\.utils)\b"
)


def sources() -> list[tuple[str, str]]:
    return [
        (path.relative_to(ROOT).as_posix(), path.read_text())
        for path in sorted(PACKAGE.rglob("*.py"))
        if COMPAT not in path.parents
    ]


def private(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def import_violations(text: str) -> tuple[list[str], list[str]]:
    """(imports of a dependency's private module or name, private names imported from another
    crush_trio module) in one module's source."""
    dependency: list[str] = []
    internal: list[str] = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            dependency += [f"import {a.name}" for a in node.names if private(a.name)]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = [a.name for a in node.names if private(a.name)]
            ours = node.level > 0 or module.split(".")[0] == "crush_trio"
            if ours:
                # crush_trio._compat is the one private package others import, by design.
                if names and not module.endswith("_compat") and "_compat." not in module:
                    internal.append(f"line {node.lineno}: from {module} import {names}")
            elif private(module) or names:
                dependency.append(f"line {node.lineno}: from {module} import ...")
    return dependency, internal


def test_the_scan_sees_private_imports() -> None:
    dependency, internal = import_violations(
        "import httpcore._async\nfrom httpx._client import X\nfrom mcp import _y\n"
        "from .db import _row\nfrom .._compat.httpcore import http11_exchange\n"
    )
    assert len(dependency) == 3 and len(internal) == 1


def test_no_module_outside_compat_touches_a_dependency_private() -> None:
    found = {}
    for path, text in sources():
        dependency, _ = import_violations(text)
        names = sorted({m[0] for m in ADAPTED_NAMES.finditer(text)})
        if (dependency or names) and path not in KNOWN_EXCEPTIONS:
            found[path] = dependency + names
    assert not found, (
        "private internals of a dependency are used outside crush_trio/_compat/ (put them in "
        f"that library's adapter module there): {found}"
    )


def test_no_private_name_is_imported_across_modules() -> None:
    found = {}
    for path, text in sources():
        _, internal = import_violations(text)
        if internal:
            found[path] = internal
    assert not found, f"private names imported from another module (make them public): {found}"


def test_every_adapter_says_which_versions_it_was_checked_against() -> None:
    adapters = [p for p in COMPAT.glob("*.py") if p.name != "__init__.py"]
    assert {p.stem for p in adapters} >= {"httpcore", "hypercorn"}
    for path in adapters:
        text = path.read_text()
        assert "CHECKED_AGAINST" in text and "def check()" in text, path.name
