"""The OpenAPI document: valid OpenAPI 3.1, one entry per route and one route per entry, wire
objects valid against their component schemas, and schemathesis against a live server (no 5xx,
every response valid against the document, the server alive afterwards)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import attrs
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from openapi_spec_validator import validate
from schemathesis.checks import positive_data_acceptance

from crush_trio import wire
from crush_trio.server import openapi
from crush_trio.server.app import create_app
from crush_trio.server.settings import Settings

if TYPE_CHECKING:
    from collections.abc import Iterator

#: Examples per operation in the suite (``just fuzz-api`` runs more).
EXAMPLES = int(os.environ.get("CRUSH_TRIO_API_FUZZ_EXAMPLES", "8"))
TOKEN = "openapi-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: Workspace operations that answered 2xx during the fuzz run.
REACHED: set[str] = set()
#: Operations left out of the fuzz run: control stops the server, event streams never end.
FUZZ_EXCLUDED_PATHS = ("/v1/control", "/v1/workspaces/{wid}/events", "/v1/workspaces/{wid}/ws")


def app_routes(app: Any) -> set[tuple[str, str]]:
    """(method, OpenAPI path) of every rule of the Quart app."""
    found = set()
    for rule in app.url_map.iter_rules():
        path = re.sub(r"<(?:[a-z]+:)?([A-Za-z_]+)>", r"{\1}", rule.rule)
        methods = {"GET"} if rule.websocket else set(rule.methods or ()) - {"HEAD", "OPTIONS"}
        found |= {(m, path) for m in methods}
    return found


def doc_routes(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(m.upper(), path) for path, ops in doc["paths"].items() for m in ops}


def mismatches(app: Any, doc: dict[str, Any]) -> list[str]:
    """Routes without an entry and entries without a route."""
    have, documented = app_routes(app), doc_routes(doc)
    problems = [f"route {m} {p} has no entry" for m, p in sorted(have - documented)]
    problems += [f"entry {m} {p} has no route" for m, p in sorted(documented - have)]
    return problems


def make_app() -> Any:
    return create_app(SimpleNamespace(backend=None), Settings(token=TOKEN))  # type: ignore[arg-type]


def test_document_is_valid_openapi_31() -> None:
    doc = openapi.document()
    assert doc["openapi"].startswith("3.1")
    validate(doc)


def test_every_route_has_an_entry_and_every_entry_a_route() -> None:
    assert mismatches(make_app(), openapi.document()) == []


def test_a_disagreement_is_found_both_ways() -> None:
    app = make_app()

    @app.get("/v1/undocumented")
    async def undocumented() -> str:
        return ""

    doc = dict(openapi.document())
    doc["paths"] = {**doc["paths"], "/v1/ghost": {"get": {}}}
    assert mismatches(app, doc) == [
        "route GET /v1/undocumented has no entry",
        "entry GET /v1/ghost has no route",
    ]


def test_debug_routes_are_the_only_ones_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRUSH_TRIO_DEBUG_ROUTES", "1")
    extra = app_routes(make_app()) - doc_routes(openapi.document())
    assert extra == set(openapi.DEBUG_ROUTES)


def _validator(name: str) -> Any:
    from jsonschema import Draft202012Validator

    doc = openapi.document()
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return Draft202012Validator(schema)


def test_wire_objects_match_their_components() -> None:
    message = wire.Message(
        "m1",
        "s1",
        wire.Role.ASSISTANT,
        [
            wire.TextPart("hi"),
            wire.ToolCallPart("c1", "bash"),
            wire.FinishPart(wire.FinishReason.END_TURN),
        ],
    )
    samples = {
        "Session": wire.Session("s1"),
        "Message": message,
        "Run": wire.Run("r1", "s1"),
        "AgentInfo": wire.AgentInfo(True, True, {"provider": "echo"}),
        "AgentEvent": wire.AgentEvent("error", "s1", "r1", "boom", "boom"),
        "Workspace": wire.Workspace("w", "/p", "/d"),
    }
    for name, obj in samples.items():
        errors = list(_validator(name).iter_errors(wire.unstructure(obj)))
        assert errors == [], (name, errors)
    frame = {
        "seq": 3,
        "type": "message",
        "payload": {"type": "updated", "payload": wire.unstructure(message)},
    }
    assert list(_validator("Frame").iter_errors(frame)) == []
    # A wrong shape is refused: the schemas say something.
    bad = wire.unstructure(message) | {"parts": [{"type": "text", "data": {"text": 5}}]}
    assert list(_validator("Message").iter_errors(bad))
    reply = {"type": "reply", "id": 1, "ok": False, "status": 404, "message": "no"}
    assert list(_validator("WsServerFrame").iter_errors(reply)) == []


# -- the live server ----------------------------------------------------------------------------


@attrs.define
class Live:
    base: str
    workspace_id: str = ""
    session_id: str = ""


def _hold_open(url: str) -> None:
    """Read the workspace's event stream until the server ends it, so the workspace stays open
    for the whole run (a creating client must open a stream within server.create_grace)."""
    timeout = httpx.Timeout(10, read=None)
    try:
        with httpx.stream("GET", url, headers=AUTH, timeout=timeout) as response:
            for _ in response.iter_lines():
                pass
    except httpx.HTTPError:
        pass


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """A real server process; afterwards it must still be alive and answering."""
    root = tmp_path_factory.mktemp("openapi")
    (root / "proj").mkdir()
    env = {**os.environ, "XDG_CONFIG_HOME": str(root / "cfg"), "HOME": str(root)}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    cmd = [sys.executable, "-m", "crush_trio", "serve", "--port", "0", "--token", TOKEN]
    cmd += ["--data-dir", str(root / "data"), "--no-access-log", "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r"(http://[^/]+)/", line)
        assert match, f"no listening line: {line!r}"
        live = Live(match.group(1))
        client_id = str(uuid.uuid4())
        got = httpx.post(
            live.base + "/v1/workspaces",
            json={"path": str(root / "proj"), "client_id": client_id},
            headers=AUTH,
            timeout=10,
        )
        assert got.status_code == 200, got.text
        live.workspace_id = got.json()["id"]
        events = f"{live.base}/v1/workspaces/{live.workspace_id}/events?client_id={client_id}"
        holder = threading.Thread(target=_hold_open, args=(events,), daemon=True)
        holder.start()
        got = httpx.post(
            f"{live.base}/v1/workspaces/{live.workspace_id}/sessions",
            json={"title": "fuzz"},
            headers=AUTH,
            timeout=10,
        )
        assert got.status_code == 200, got.text
        live.session_id = got.json()["id"]
        yield live
        assert proc.poll() is None, "the server exited during the fuzz run"
        health = httpx.get(live.base + "/v1/health", timeout=10)
        assert health.status_code == 200
    finally:
        if proc.stdout is not None:
            proc.stdout.close()
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_document_served_behind_the_token(live_server: Live) -> None:
    base = live_server.base
    assert httpx.get(base + "/v1/openapi.json", timeout=10).status_code == 401
    got = httpx.get(
        base + "/v1/openapi.json",
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    )
    assert got.status_code == 200
    assert got.json() == openapi.document()
    page = httpx.get(base + "/v1/docs?token=" + TOKEN, timeout=10)
    assert page.status_code == 200
    assert "/v1/openapi.json" in page.text
    assert "<script" not in page.text


schema = schemathesis.openapi.from_dict(openapi.document())
for _path in FUZZ_EXCLUDED_PATHS:
    schema = schema.exclude(path=_path)


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=os.environ.get("CRUSH_TRIO_API_FUZZ_EXAMPLES") is None,
)
def test_api_fuzz(case: Any, live_server: Live) -> None:
    # Most examples address the open workspace and its session, so that the routes behind the
    # 404 of an unknown id are exercised too.
    params = case.path_parameters or {}
    if "wid" in params:
        params["wid"] = live_server.workspace_id
    if "sid" in params and len(params["sid"]) % 2 == 0:
        params["sid"] = live_server.session_id
    # Schema-valid is not always acceptable: a workspace path must name an existing directory,
    # ids must exist, a title must not be blank. Those answers are 4xx with the Error envelope,
    # which the other checks hold the server to.
    response = case.call_and_validate(
        base_url=live_server.base,
        headers=AUTH,
        timeout=30,
        excluded_checks=[positive_data_acceptance],
    )
    if response.status_code < 300 and "{wid}" in case.path:
        REACHED.add(f"{case.method} {case.path}")


def test_fuzz_reached_the_workspace_routes() -> None:
    """The examples got past the 404 of an unknown id: the fuzz run exercised real state."""
    if not REACHED:
        pytest.skip("the fuzz run did not run in this session")
    assert len(REACHED) >= 10, sorted(REACHED)
