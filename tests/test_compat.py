"""The adapters to dependencies' internals (crush_trio/_compat/) and the rule they keep.

Each adapter checks, when imported, the private names it relies on; these tests assert that the
check passes on the pinned versions, that the pins are the versions the adapter names, and that a
simulated upgrade (a name gone, a changed signature) raises a clear CompatError rather than
letting the code fall back silently. The last tests scan the source tree for private imports
and private names of dependencies outside crush_trio/_compat/, and for classes that override a
private method of a dependency's class.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import tomllib
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio_websocket
from hypercorn.protocol import ws_stream
from hypercorn.trio import tcp_server
from wsproto.extensions import PerMessageDeflate

from crush_trio._compat import CompatError
from crush_trio._compat import hypercorn as hypercorn_compat
from crush_trio._compat import trio_websocket as trio_websocket_compat

if TYPE_CHECKING:
    from types import ModuleType

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
    assert spec is not None
    assert spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


ADAPTERS = [hypercorn_compat, trio_websocket_compat]


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda m: m.__name__)
def test_an_adapter_names_the_pinned_versions_and_they_are_installed(adapter: Any) -> None:
    pins = pinned()
    for name, version in adapter.CHECKED_AGAINST.items():
        assert pins.get(name) == version, f"pyproject.toml must pin {name}=={version}"
        assert metadata.version(name) == version
    adapter.check()


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
    assert "read_data" in vars(HttpConnection)
    assert "close_connection" in vars(HttpConnection)
    assert "_read_data" not in vars(HttpConnection)
    assert "_close" not in vars(HttpConnection)


def test_the_hypercorn_check_fails_loudly_when_the_h11_state_is_no_longer_reachable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hypercorn.protocol.h11 import H11Protocol

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        self.h11 = None

    monkeypatch.setattr(H11Protocol, "__init__", init)
    with pytest.raises(CompatError, match=r"H11Protocol no longer sets self\.connection"):
        hypercorn_compat.check()


def test_a_connection_without_h11_state_is_never_taken_back() -> None:
    """Before its protocol is set up (or for HTTP/2, a websocket): busy, so hypercorn keeps it."""
    connection = hypercorn_compat.HypercornConnection.__new__(hypercorn_compat.HypercornConnection)
    assert connection.cycle_state() == "busy"


def test_the_hypercorn_check_fails_loudly_when_the_websocket_extension_name_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(ws_stream, "PerMessageDeflate")
    with pytest.raises(CompatError, match=r"ws_stream\.PerMessageDeflate is no longer"):
        hypercorn_compat.check()


def test_the_hypercorn_check_fails_loudly_when_the_handshake_builds_its_extension_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def accept(self: Any, subprotocol: Any, additional_headers: Any) -> Any:
        return self.build_extensions()  # an upgrade that no longer uses the module-level name

    monkeypatch.setattr(ws_stream.Handshake, "accept", accept)
    with pytest.raises(CompatError, match="no longer builds its extension as PerMessageDeflate"):
        hypercorn_compat.check()


def test_hypercorn_negotiates_the_extension_class_it_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ws_stream, "PerMessageDeflate", ws_stream.PerMessageDeflate)  # restored
    built: list[PerMessageDeflate] = []

    class Recorded(PerMessageDeflate):
        def __init__(self) -> None:
            super().__init__()
            built.append(self)

    hypercorn_compat.use_websocket_deflate(Recorded)
    handshake = ws_stream.Handshake(
        [
            (b"sec-websocket-version", b"13"),
            (b"sec-websocket-key", b"dGhlIHNhbXBsZSBub25jZQ=="),
            (b"sec-websocket-extensions", b"permessage-deflate"),
        ],
        "1.1",
    )
    status, headers, _ = handshake.accept(None, [])
    assert status == 101
    assert len(built) == 1
    assert built[0].enabled()
    assert (b"sec-websocket-extensions", b"permessage-deflate") in headers


def test_the_trio_websocket_check_fails_loudly_when_an_extended_method_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(trio_websocket.WebSocketConnection, "_handle_close_connection_event")
    with pytest.raises(CompatError) as info:
        trio_websocket_compat.check()
    message = str(info.value)
    assert "WebSocketConnection._handle_close_connection_event is gone" in message
    assert "checked against trio-websocket 0.12.2" in message


def test_the_trio_websocket_check_fails_loudly_when_a_replaced_method_changes_signature(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def accept(self: Any, request: Any, subprotocol: Any) -> None:
        pass

    monkeypatch.setattr(trio_websocket.WebSocketConnection, "_accept", accept)
    with pytest.raises(CompatError, match=r"_accept now takes \('request', 'subprotocol'\)"):
        trio_websocket_compat.check()


def test_the_trio_websocket_check_fails_loudly_when_the_reader_stops_calling_the_handler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def reader_task(self: Any) -> None:
        await self._dispatch_events()

    monkeypatch.setattr(trio_websocket.WebSocketConnection, "_reader_task", reader_task)
    with pytest.raises(CompatError, match="the reader no longer hands CloseConnection"):
        trio_websocket_compat.check()


def test_the_trio_websocket_check_fails_loudly_when_accept_stops_calling_the_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def accept(self: Any, **kwargs: Any) -> Any:
        return await self._connection._accept_request(self._event, **kwargs)

    monkeypatch.setattr(trio_websocket.WebSocketRequest, "accept", accept)
    with pytest.raises(CompatError, match="accept no longer calls the connection's _accept"):
        trio_websocket_compat.check()


@pytest.mark.parametrize(
    ("attribute", "complaint"),
    [
        ("_initial_request", "_initial_request no longer holds the client's Request"),
        ("_wsproto", "_wsproto no longer holds the wsproto connection"),
        ("_close_reason", "_close_reason no longer starts as None"),
        ("_reader_running", "_reader_running no longer starts as True"),
        ("_recv_channel", "_recv_channel is no longer a memory receive channel"),
        ("_open_handshake", "_open_handshake is no longer a trio.Event"),
    ],
)
def test_the_trio_websocket_check_fails_loudly_when_a_connection_attribute_is_renamed(
    monkeypatch: pytest.MonkeyPatch, attribute: str, complaint: str
) -> None:
    original = trio_websocket.WebSocketConnection.__init__

    def renamed(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        setattr(self, f"{attribute}_v2", vars(self).pop(attribute))  # an upgrade's rename

    monkeypatch.setattr(trio_websocket.WebSocketConnection, "__init__", renamed)
    with pytest.raises(CompatError, match=re.escape(complaint)):
        trio_websocket_compat.check()


def test_the_trio_websocket_check_fails_loudly_when_wsproto_reports_an_extension_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from wsproto.connection import Connection, ConnectionState

    original = Connection.events

    def closing(self: Any) -> Any:
        events = list(original(self))
        self._state = ConnectionState.CLOSED  # an upgrade that ends the connection itself
        return iter(events)

    monkeypatch.setattr(Connection, "events", closing)
    with pytest.raises(CompatError, match="wsproto now reports an extension's MESSAGE_TOO_BIG"):
        trio_websocket_compat.check()


def test_importing_the_trio_websocket_adapter_fails_loudly_after_a_breaking_upgrade(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(trio_websocket.WebSocketConnection, "_get_request")
    with pytest.raises(CompatError, match=r"WebSocketConnection\._get_request is gone"):
        load_fresh(trio_websocket_compat)


# ---------------------------------------------------------------------------------------------
# The rule, over the source tree


#: Private names of dependencies that only their adapter may use.
ADAPTED_NAMES = re.compile(
    r"\b(_h11_state|_httpcore_stream|_httpx_utils|_read_data|HTTP11ConnectionByteStream"
    r"|PoolByteStream|BoundAsyncStream|AsyncResponseStream|hypercorn\.trio\.tcp_server"
    r"|hypercorn\.trio\.lifespan|hypercorn\.trio\.worker_context|hypercorn\.utils"
    r"|hypercorn\.protocol|trio_websocket\._impl|_initial_request|_wsproto|_close_reason"
    r"|_recv_channel|_reader_running|_reader_task|_get_request|_open_handshake"
    r"|_handle_\w+_event|_inbound_compressed|_inbound_is_compressible|_compressor"
    r"|_decompressor)\b"
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
    assert len(dependency) == 3
    assert len(internal) == 1


#: Private names every class may define over its base (ABC and typing bookkeeping).
BOOKKEEPING = frozenset({"_abc_impl", "_is_protocol", "_is_runtime_protocol"})


def imported_objects(tree: ast.Module, module: str) -> dict[str, tuple[str, str | None]]:
    """Local name -> (module, attribute or None for the module itself) of every import of a
    dependency, or of an adapter in crush_trio._compat, in ``tree`` (the module ``module``)."""
    package = module.rsplit(".", 1)[0]
    found: dict[str, tuple[str, str | None]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0],
                    None,
                )
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                found[alias.asname or alias.name] = (base, alias.name)
    return {
        name: (mod, attr)
        for name, (mod, attr) in found.items()
        if not mod.startswith("crush_trio") or mod.startswith("crush_trio._compat")
    }


def resolve(expr: ast.expr, imported: dict[str, tuple[str, str | None]]) -> object | None:
    """The object a base-class expression names, when it comes from an import in ``imported``."""
    attrs: list[str] = []
    while isinstance(expr, ast.Attribute):
        attrs.insert(0, expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name) or expr.id not in imported:
        return None
    module, attr = imported[expr.id]
    obj: object = importlib.import_module(module)
    for name in [attr, *attrs] if attr else attrs:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def private_overrides(text: str, module: str) -> list[str]:
    """The private names (methods or attributes) that the classes of one module's source define
    over a dependency's class they subclass (an adapter's class counts as the dependency's)."""
    tree = ast.parse(text)
    imported = imported_objects(tree, module)
    found: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = [b for b in (resolve(e, imported) for e in node.bases) if isinstance(b, type)]
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                names = [item.name]
            elif isinstance(item, ast.Assign):
                names = [t.id for t in item.targets if isinstance(t, ast.Name)]
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                names = [item.target.id]
            else:
                continue
            for name in names:
                if not private(name) or name.endswith("_") or name in BOOKKEEPING:
                    continue
                for base in bases:
                    if hasattr(base, name):
                        found.append(f"{node.name}.{name} over {base.__module__}.{base.__name__}")
    return found


def test_the_scan_sees_a_private_method_overridden_in_a_subclass() -> None:
    text = (
        "import trio\nfrom trio_websocket import WebSocketConnection\n"
        "from .._compat import hypercorn as compat\n"
        "class A(WebSocketConnection):\n    async def _accept(self, r, s, h): ...\n"
        "    async def accept_all(self): ...\n"
        "class B(compat.HypercornConnection):\n    async def _close(self): ...\n"
        "class C(trio.abc.Stream):\n    _stream = None\n    _abc_impl = None\n"
    )
    assert private_overrides(text, "crush_trio.server.probe") == [
        "A._accept over trio_websocket._impl.WebSocketConnection",
        "B._close over crush_trio._compat.hypercorn.HypercornConnection",
    ]


def test_no_module_outside_compat_touches_a_dependency_private() -> None:
    found = {}
    for path, text in sources():
        dependency, _ = import_violations(text)
        names = sorted({m[0] for m in ADAPTED_NAMES.finditer(text)})
        module = path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        overrides = private_overrides(text, module)
        if dependency or names or overrides:
            found[path] = dependency + names + overrides
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
    assert {p.stem for p in adapters} >= {"hypercorn", "trio_websocket"}
    for path in adapters:
        text = path.read_text()
        assert "CHECKED_AGAINST" in text, path.name
        assert "def check()" in text, path.name
