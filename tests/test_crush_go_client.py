"""Crush's own Go client against this server, replayed call by call over the Unix socket.

Each request below is the one Crush's client (charmbracelet/crush at commit 37f36e9) sends, with
its method, path, query, headers and body as ``internal/client`` builds them: no token, ``Host:
api.crush.localhost``, ``Content-Type: text/plain`` on a body it sets no type for. Each answer
is checked the way Go's ``encoding/json`` decodes it into the struct the client uses: a key of
the wrong JSON type fails the whole decode (an SSE event is then dropped, a request fails), a
``null`` leaves the field's zero value, unknown keys are ignored. The Go file and function of
each step are cited next to it.
"""

from __future__ import annotations

import math
import uuid
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import httpx
import orjson
import pytest
import trio

from crush_trio.errors import ProviderError
from crush_trio.providers.scripted import Gate, ScriptedModel, Step
from crush_trio.server.serve import ServeOptions, ServerHandle, serve
from tests.conftest import WAIT

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

#: The key of the configured provider: it must never appear in an answer.
SECRET: Final = "sk-never-on-the-wire"
CONFIG: Final = {
    "providers": {
        "local": {
            "type": "openai",
            "base_url": "http://127.0.0.1:9/v1",
            "api_key": SECRET,
            "extra_headers": {"X-Secret": SECRET},
            "models": [
                {"id": "small-1", "name": "Small One", "context_window": 32000},
                {
                    "id": "big-1",
                    "name": "Big One",
                    "context_window": 200000,
                    "default_max_tokens": 8192,
                    "cost_per_1m_in": 3.0,
                    "cost_per_1m_out": 15.0,
                },
            ],
        }
    },
    "models": {"large": {"provider": "local", "model": "small-1"}},
}
#: Crush's DummyHost (internal/client/client.go): the Host of every request over a socket.
DUMMY_HOST: Final = "api.crush.localhost"

# -- Go's encoding/json, for the structs the client decodes into ------------------------------

STR, INT, FLOAT, BOOL, ANY = "string", "int64", "float64", "bool", "any"


def LIST(of: Any) -> tuple[str, Any]:
    return ("list", of)


def MAP(of: Any) -> tuple[str, Any]:
    return ("map", of)


# charm.land/catwalk pkg/catwalk/provider.go: Model.
CATWALK_MODEL: Final = {
    "id": STR, "name": STR, "cost_per_1m_in": FLOAT, "cost_per_1m_out": FLOAT,
    "cost_per_1m_in_cached": FLOAT, "cost_per_1m_out_cached": FLOAT, "context_window": INT,
    "default_max_tokens": INT, "can_reason": BOOL, "reasoning_levels": LIST(STR),
    "default_reasoning_effort": STR, "supports_attachments": BOOL, "options": ANY,
}  # fmt: skip
# charm.land/catwalk pkg/catwalk/provider.go: Provider (config.Providers returns these).
CATWALK_PROVIDER: Final = {
    "name": STR, "id": STR, "api_key": STR, "api_endpoint": STR, "type": STR,
    "default_large_model_id": STR, "default_small_model_id": STR,
    "models": LIST(CATWALK_MODEL), "default_headers": MAP(STR),
}  # fmt: skip
# internal/config/config.go: SelectedModel.
SELECTED_MODEL: Final = {
    "model": STR, "provider": STR, "reasoning_effort": STR, "think": BOOL, "max_tokens": INT,
    "temperature": FLOAT, "top_p": FLOAT, "top_k": INT, "frequency_penalty": FLOAT,
    "presence_penalty": FLOAT, "provider_options": MAP(ANY),
}  # fmt: skip
# internal/config/config.go: ProviderConfig.
PROVIDER_CONFIG: Final = {
    "id": STR, "name": STR, "base_url": STR, "type": STR, "api_key": STR, "oauth": ANY,
    "disable": BOOL, "system_prompt_prefix": STR, "extra_headers": MAP(STR),
    "extra_body": MAP(ANY), "provider_options": MAP(ANY), "aws_auth_refresh": STR,
    "flat_rate": BOOL, "discover_models": BOOL, "models": LIST(CATWALK_MODEL),
}  # fmt: skip
# internal/config/config.go: TUIOptions and Options.
TUI_OPTIONS: Final = {
    "compact_mode": BOOL, "diff_mode": STR, "completions": ANY, "transparent": BOOL,
    "scrollbar": STR,
}  # fmt: skip
OPTIONS: Final = {
    "context_paths": LIST(STR), "global_context_paths": LIST(STR), "skills_paths": LIST(STR),
    "tui": TUI_OPTIONS, "debug": BOOL, "debug_lsp": BOOL, "disable_auto_summarize": BOOL,
    "data_directory": STR, "disabled_tools": LIST(STR), "disable_provider_auto_update": BOOL,
    "disable_default_providers": BOOL, "attribution": ANY, "disable_metrics": BOOL,
    "initialize_as": STR, "auto_lsp": BOOL, "progress": BOOL, "notifications": STR,
    "disabled_skills": LIST(STR),
}  # fmt: skip
# internal/config/config.go: Config.
CONFIG_STRUCT: Final = {
    "$schema": STR, "models": MAP(SELECTED_MODEL), "recent_models": MAP(LIST(SELECTED_MODEL)),
    "providers": MAP(PROVIDER_CONFIG), "mcp": MAP(ANY), "lsp": MAP(ANY), "options": OPTIONS,
    "permissions": {"allowed_tools": LIST(STR)}, "tools": ANY, "hooks": MAP(ANY),
    "env": MAP(STR),
}  # fmt: skip
# internal/proto/version.go: VersionInfo.
VERSION_INFO: Final = {
    "version": STR, "commit": STR, "build_id": STR, "go_version": STR, "platform": STR,
}  # fmt: skip
# internal/proto/proto.go: Workspace.
WORKSPACE: Final = {
    "id": STR, "path": STR, "yolo": BOOL, "debug": BOOL, "data_dir": STR, "version": STR,
    "client_id": STR, "config": CONFIG_STRUCT, "env": LIST(STR), "channels": LIST(STR),
    "skills": LIST(ANY),
}  # fmt: skip
# internal/proto/proto.go: AgentInfo.
AGENT_INFO: Final = {
    "is_busy": BOOL, "is_ready": BOOL, "model": CATWALK_MODEL, "model_cfg": SELECTED_MODEL,
}  # fmt: skip
# internal/proto/session.go: Session (AgentSession in proto.go embeds it, plus is_busy).
SESSION: Final = {
    "id": STR, "parent_session_id": STR, "title": STR, "message_count": INT,
    "prompt_tokens": INT, "completion_tokens": INT, "summary_message_id": STR, "cost": FLOAT,
    "todos": LIST({"content": STR, "status": STR, "active_form": STR}), "created_at": INT,
    "updated_at": INT, "is_busy": BOOL, "attached_clients": INT,
}  # fmt: skip
# internal/proto/history.go: File.
FILE: Final = {
    "id": STR, "session_id": STR, "path": STR, "content": STR, "version": INT,
    "created_at": INT, "updated_at": INT,
}  # fmt: skip
# internal/proto/message.go: the part structs UnmarshalParts fills, by wrapper type.
PARTS: Final = {
    "reasoning": {"thinking": STR, "signature": STR, "started_at": INT, "finished_at": INT},
    "text": {"text": STR},
    "image_url": {"url": STR, "detail": STR},
    "binary": {"path": STR, "data": STR},  # BinaryContent: no tags, Data is base64 []byte
    "tool_call": {"id": STR, "name": STR, "input": STR, "type": STR, "finished": BOOL},
    "tool_result": {
        "tool_call_id": STR, "name": STR, "content": STR, "data": STR, "mime_type": STR,
        "metadata": STR, "is_error": BOOL,
    },
    "finish": {"reason": STR, "time": INT, "message": STR, "details": STR},
    "shell_command": {"command": STR, "output": STR, "exit_code": INT},
}  # fmt: skip
# internal/proto/message.go: Message (its UnmarshalJSON needs "parts" to be a list).
MESSAGE: Final = {
    "id": STR, "role": STR, "session_id": STR, "parts": "parts", "model": STR,
    "provider": STR, "created_at": INT, "updated_at": INT, "is_summary_message": BOOL,
}  # fmt: skip
# internal/proto/proto.go: RunComplete.
RUN_COMPLETE: Final = {
    "session_id": STR, "run_id": STR, "message_id": STR, "text": STR, "error": STR,
    "cancelled": BOOL,
}  # fmt: skip
# internal/proto/agent.go: AgentEvent ("message" is a Message; "error" a string).
AGENT_EVENT: Final = {
    "type": STR, "message": MESSAGE, "error": STR, "run_id": STR, "session_id": STR,
    "session_title": STR, "progress": STR, "done": BOOL, "aws_sso_command": STR,
    "aws_sso_url": STR,
}  # fmt: skip
# internal/proto/permission.go: PermissionRequest; Params by tool (internal/agent/tools).
PERMISSION_REQUEST: Final = {
    "id": STR, "session_id": STR, "tool_call_id": STR, "tool_name": STR,
    "description": STR, "action": STR, "params": ANY, "path": STR,
}  # fmt: skip
WRITE_PERMISSION_PARAMS: Final = {"file_path": STR, "old_content": STR, "new_content": STR}
# internal/client/proto.go SubscribeEvents: the payload types it decodes, and into what.
EVENT_PAYLOADS: Final = {
    "message": MESSAGE,
    "session": SESSION,
    "agent_event": AGENT_EVENT,
    "run_complete": RUN_COMPLETE,
    "permission_request": PERMISSION_REQUEST,
    "permission_notification": {"tool_call_id": STR, "granted": BOOL, "denied": BOOL},
}


def go_decode_errors(value: Any, shape: Any, where: str = "$") -> list[str]:
    """Where ``encoding/json`` would fail to decode ``value`` into ``shape`` (none: it works)."""
    if value is None or shape == ANY:
        return []
    if shape == STR:
        return [] if isinstance(value, str) else [f"{where}: {value!r} is not a string"]
    if shape == BOOL:
        return [] if isinstance(value, bool) else [f"{where}: {value!r} is not a bool"]
    if shape == INT:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return [] if ok else [f"{where}: {value!r} is not an integer"]
    if shape == FLOAT:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return [] if ok else [f"{where}: {value!r} is not a number"]
    if shape == "parts":
        if not isinstance(value, list):
            return [f"{where}: parts must be a list"]
        problems = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in PARTS:
                problems.append(f"{where}[{i}]: unknown part type {kind!r}")
            else:
                problems += go_decode_errors(part.get("data"), PARTS[kind], f"{where}[{i}].data")
        return problems
    if isinstance(shape, tuple):
        kind, inner = shape
        if kind == "list":
            if not isinstance(value, list):
                return [f"{where}: {value!r} is not a list"]
            return [
                e for i, v in enumerate(value) for e in go_decode_errors(v, inner, f"{where}[{i}]")
            ]
        if not isinstance(value, dict):
            return [f"{where}: {value!r} is not an object"]
        return [e for k, v in value.items() for e in go_decode_errors(v, inner, f"{where}.{k}")]
    if not isinstance(value, dict):
        return [f"{where}: {value!r} is not an object"]
    return [
        e for key, sub in shape.items() if key in value
        for e in go_decode_errors(value[key], sub, f"{where}.{key}")
    ]  # fmt: skip


def decoded(data: Any, shape: Any) -> Any:
    """``data`` once it decodes into ``shape`` (fails the test otherwise)."""
    assert go_decode_errors(data, shape) == []
    return data


# -- the client, as internal/client builds its requests ----------------------------------------


class GoClient:
    """``client.Client`` (internal/client/client.go): one client id (a UUID minted in
    NewClient), no token, requests over the Unix socket with ``Host: api.crush.localhost``."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.client_id = str(uuid.uuid4())
        self.answers: list[httpx.Response] = []

    async def send(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, str] | None = None,
        body: Any = None,
        json: bool = True,
    ) -> httpx.Response:
        """``sendReq``/``buildReq``: the path joined under ``/v1``; a body without a type set
        by the caller goes as ``text/plain`` (``json=False``)."""
        headers = {"Host": DUMMY_HOST, "User-Agent": "Go-http-client/1.1"}
        content = None
        if body is not None:
            content = orjson.dumps(body)
            headers["Content-Type"] = "application/json" if json else "text/plain"
        r = await self.http.request(
            method, "/v1" + path, params=query, content=content, headers=headers
        )
        self.answers.append(r)
        assert SECRET not in r.text, f"{method} {path} answered the provider's key"
        return r

    async def ok(self, method: str, path: str, shape: Any = None, **kw: Any) -> Any:
        """A call whose Go function fails unless the status is 200 (``checkStatus`` or its
        ``rsp.StatusCode != http.StatusOK`` test) and the body decodes into ``shape``."""
        r = await self.send(method, path, **kw)
        assert r.status_code == 200, (method, path, r.status_code, r.text)
        return decoded(r.json(), shape) if shape is not None else None


@asynccontextmanager
async def crush_socket_server(tmp_path: Path, model: ScriptedModel) -> AsyncIterator[GoClient]:
    """The server on a Unix socket (Crush's default transport), configured with a provider
    whose key must never reach a client, and the Go client on it."""
    import tempfile

    sock = Path(tempfile.mkdtemp(prefix="ct-")) / "crush.sock"  # AF_UNIX paths are short
    config = tmp_path / "crush.json"
    config.write_bytes(orjson.dumps(CONFIG))
    options = ServeOptions(
        host=f"unix:{sock}",
        data_dir=tmp_path / "data",
        config_file=config,
        user_config_dir=tmp_path / "user-config",
        access_log=False,
        provider_factory=model,
    )
    async with trio.open_nursery() as nursery:
        handle: ServerHandle = await nursery.start(partial(serve, options))
        transport = httpx.AsyncHTTPTransport(uds=str(sock))
        async with httpx.AsyncClient(
            transport=transport, base_url=f"http://{DUMMY_HOST}", timeout=WAIT
        ) as http:
            yield GoClient(http)
        handle.stop()


class Events:
    """``SubscribeEvents`` (internal/client/proto.go): read ``data:`` lines, decode the
    ``pubsub.Payload`` envelope, then the payload into ``pubsub.Event[T]`` of its type; other
    lines (``id:``, comments) are skipped with a warning, unknown types too."""

    def __init__(self) -> None:
        self.send, self.receive = trio.open_memory_channel[tuple[str, dict[str, Any]]](math.inf)
        self.unknown: set[str] = set()
        self.undecodable: list[str] = []

    async def read(self, c: GoClient, wid: str, *, task_status: Any) -> None:
        headers = {
            "Host": DUMMY_HOST,
            "Accept": "text/event-stream",
            "Cache-Control": "no-cache",
            "Connection": "keep-alive",
        }
        async with c.http.stream(
            "GET",
            f"/v1/workspaces/{wid}/events",
            params={"client_id": c.client_id},
            headers=headers,
            timeout=httpx.Timeout(WAIT, read=None),
        ) as r:
            assert r.status_code == 200  # checkStatus
            task_status.started()
            async for line in r.aiter_lines():
                data = line.strip()
                if not data.startswith("data:"):
                    continue
                envelope = orjson.loads(data[len("data:") :].strip())
                kind = envelope["type"]
                if kind not in EVENT_PAYLOADS:
                    self.unknown.add(kind)
                    continue
                event = envelope["payload"]
                problems = go_decode_errors(event, {"type": STR, "payload": EVENT_PAYLOADS[kind]})
                if problems:
                    self.undecodable += problems
                    continue
                self.send.send_nowait((kind, event["payload"]))

    async def until(self, pred: Callable[[str, dict[str, Any]], bool]) -> list[tuple[str, Any]]:
        seen = []
        with trio.fail_after(WAIT):
            async for kind, payload in self.receive:
                seen.append((kind, payload))
                if pred(kind, payload):
                    return seen
        raise AssertionError("the event stream ended")


async def open_workspace(c: GoClient, project: Path) -> dict[str, Any]:
    """internal/cmd/root.go connectToServer → ensureServer, then CreateWorkspace."""
    # ensureServer → restartIfStale: VersionInfo (internal/client/client.go).
    version = await c.ok("GET", "/version", VERSION_INFO)
    assert version["version"]  # differs from Crush's own, so it asks the server to stand down:
    # ShutdownServerIfIdle sends a text/plain body; refusing it (neither 200 nor 409 nor 400)
    # keeps the server running ("will not stand down; reusing it").
    r = await c.send("POST", "/control", body={"command": "shutdown_if_idle"}, json=False)
    assert r.status_code == 415, r.text
    # waitForServerReady → probeHealth: any 2xx.
    r = await c.send("GET", "/health")
    assert 200 <= r.status_code < 300
    # CreateWorkspace (internal/client/proto.go): the whole proto.Workspace, env included.
    ws = await c.ok(
        "POST",
        "/workspaces",
        WORKSPACE,
        body={
            "path": str(project),
            "version": "v0.99.0",
            "client_id": c.client_id,
            "env": ["HOME=/home/someone", "TERM=xterm"],
        },
    )
    # connectToServer reads ws.Config.Options.DataDirectory; run.go checks IsConfigured (an
    # enabled provider), NewClientWorkspace calls Config.SetupAgents (reads Options).
    cfg = ws["config"]
    assert cfg["options"]["data_directory"]
    assert isinstance(cfg["options"]["tui"], dict)
    assert [p for p in cfg["providers"].values() if not p.get("disable")]
    return dict(ws)


async def test_crush_run_in_client_mode(tmp_path: Path) -> None:
    """``crush run -m big-1 "..."`` with CRUSH_CLIENT_SERVER=1 (internal/cmd/run.go RunE)."""
    model = ScriptedModel([Step("the answer"), Step("half", error=ProviderError("it broke"))])
    project = tmp_path / "project"
    project.mkdir()
    with trio.fail_after(WAIT * 3):
        async with crush_socket_server(tmp_path, model) as c, trio.open_nursery() as nursery:
            ws = await open_workspace(c, project)
            w = f"/workspaces/{ws['id']}"
            cfg = ws["config"]
            assert cfg["providers"]["local"]["base_url"] == "http://127.0.0.1:9/v1"
            assert cfg["models"]["large"] == {"provider": "local", "model": "small-1"}
            # InitCoderAgentNonInteractive → InitiateAgentProcessing (internal/client/proto.go).
            await c.ok("POST", w + "/agent/init", body={"interactive": False})
            # runNonInteractive → overrideModels: GetConfig, findModelMatches over
            # cfg.Providers, UpdatePreferredModel (scope is config.ScopeWorkspace, a number).
            got = await c.ok("GET", w + "/config", CONFIG_STRUCT)
            matches = [
                (name, m["id"])
                for name, p in got["providers"].items()
                if not p.get("disable")
                for m in p["models"]
                if m["id"].lower() == "big-1"
            ]
            assert matches == [("local", "big-1")]
            choice = {"provider": "local", "model": "big-1"}
            await c.ok(
                "POST",
                w + "/config/model",
                body={"scope": 1, "model_type": "large", "model": choice},
            )
            # GetDefaultSmallModel, then UpdatePreferredModel for the small role.
            small = await c.ok(
                "GET",
                w + "/agent/default-small-model",
                SELECTED_MODEL,
                query={"provider_id": "local"},
            )
            assert small["provider"] == "local"
            assert small["model"] in ("small-1", "big-1")
            await c.ok(
                "POST",
                w + "/config/model",
                body={"scope": 1, "model_type": "small", "model": small},
            )
            await c.ok("POST", w + "/agent/update")
            # waitForAgent: GetAgentInfo (checkStatus) every 200 ms until is_ready; the agent
            # is ready as soon as the workspace is open, so the first poll ends the wait.
            info = await c.ok("GET", w + "/agent", AGENT_INFO)
            assert info["is_ready"] is True
            assert info["model"]["id"] == "big-1"
            assert info["model"]["context_window"] == 200000
            assert info["model"]["cost_per_1m_in"] == 3.0
            assert info["model_cfg"] == {"provider": "local", "model": "big-1"}
            # "Force-update agent models": UpdateAgent, no body and no content type.
            await c.ok("POST", w + "/agent/update")
            # resolveSession → CreateSession: a whole proto.Session, 200 required.
            session = await c.ok(
                "POST",
                w + "/sessions",
                SESSION,
                body={"id": "", "parent_session_id": "", "title": "non-interactive",
                      "message_count": 0, "prompt_tokens": 0, "completion_tokens": 0,
                      "summary_message_id": "", "cost": 0, "created_at": 0, "updated_at": 0,
                      "is_busy": False, "attached_clients": 0},
            )  # fmt: skip
            sid = session["id"]
            # SubscribeEvents before SendMessage.
            events = Events()
            await nursery.start(events.read, c, ws["id"])
            # SendMessage with a fresh UUID RunID: 200 or 202.
            run_id = str(uuid.uuid4())
            r = await c.send(
                "POST", w + "/agent", body={"session_id": sid, "run_id": run_id, "prompt": "hi"}
            )
            assert r.status_code in (200, 202), r.text
            # runStream.handle: message events are ignored with a RunID; run_complete ends it.
            seen = await events.until(
                lambda k, p: k == "run_complete" and p.get("run_id") == run_id
            )
            done = seen[-1][1]
            assert done["text"] == "the answer"
            assert not done.get("error")
            assert done["session_id"] == sid
            assert done["message_id"]
            assert any(k == "message" and p["role"] == "assistant" for k, p in seen)
            assert model.requests[0].model.id == "big-1"  # the override reached the model
            # A failed run: the agent_event error decodes (run_id is ours, error non-empty),
            # so `crush run` reports "agent error: ..." or "agent run failed: ...".
            failing = str(uuid.uuid4())
            r = await c.send(
                "POST", w + "/agent", body={"session_id": sid, "run_id": failing, "prompt": "x"}
            )
            assert r.status_code == 202
            seen = await events.until(
                lambda k, p: k == "run_complete" and p.get("run_id") == failing
            )
            errors = [p for k, p in seen if k == "agent_event" and p["type"] == "error"]
            assert errors
            assert errors[0]["run_id"] == failing
            assert errors[0]["error"] == "it broke"
            assert errors[0]["message"] is None  # null: Go leaves the Message as it is
            assert seen[-1][1]["error"] == "it broke"
            assert events.undecodable == []
            # cleanup: RetireClient (DELETE /v1/clients/{id}).
            await c.ok("DELETE", f"/clients/{c.client_id}")
            nursery.cancel_scope.cancel()


async def test_crush_tui_start_session_busy_and_cancel(tmp_path: Path) -> None:
    """The client/server TUI: setupClientServerWorkspace (internal/cmd/root.go), its first
    screen (internal/ui/model/ui.go), opening a session (internal/ui/model/session.go
    loadSession), the busy state (ClientWorkspace.AgentIsSessionBusy) and Esc
    (ClientWorkspace.AgentCancel), all in internal/workspace/client_workspace.go."""
    gate = Gate()
    model = ScriptedModel(
        [
            Step(tool_calls=[("write", {"path": "notes.txt", "content": "hello"})]),
            Step("written"),
            Step("a long answer that is cancelled", gate_mid=gate),
        ]
    )
    project = tmp_path / "project"
    project.mkdir()
    with trio.fail_after(WAIT * 3):
        async with crush_socket_server(tmp_path, model) as c, trio.open_nursery() as nursery:
            ws = await open_workspace(c, project)
            wid = ws["id"]
            w = f"/workspaces/{wid}"
            # Config is configured → InitCoderAgent (interactive).
            await c.ok("POST", w + "/agent/init", body={"interactive": True})
            # Subscribe → runSubscription → SubscribeEvents.
            events = Events()
            await nursery.start(events.read, c, wid)
            # The first screen: yolo state, project init check, the agent's model for the
            # header, sessions, the prompt history, a refreshed workspace snapshot.
            assert await c.ok("GET", w + "/permissions/skip", {"skip": BOOL}) == {"skip": False}
            needs = await c.ok("GET", w + "/project/needs-init", {"needs_init": BOOL})
            assert needs == {"needs_init": False}
            info = await c.ok("GET", w + "/agent", AGENT_INFO)
            assert info["is_ready"]
            assert not info["is_busy"]
            assert info["model"]["id"] == "small-1"
            assert info["model"]["name"] == "Small One"
            assert info["model_cfg"]["provider"] == "local"
            assert await c.ok("GET", w + "/sessions", LIST(SESSION)) == []
            assert await c.ok("GET", w + "/messages/user", LIST(MESSAGE)) == []
            await c.ok("GET", w, WORKSPACE)
            # A new session, then loadSession: GetSession, ListSessionHistory,
            # FileTrackerListReadFiles, and reportCurrentSession.
            session = await c.ok("POST", w + "/sessions", SESSION, body={"title": "tui"})
            sid = session["id"]
            await c.ok("GET", f"{w}/sessions/{sid}", SESSION)
            # Renaming in the sessions dialog: SaveSession PUTs the whole proto.Session.
            renamed = await c.ok(
                "PUT", f"{w}/sessions/{sid}", SESSION, body={**session, "title": "renamed"}
            )
            assert renamed["title"] == "renamed"
            assert renamed["id"] == sid
            assert await c.ok("GET", f"{w}/sessions/{sid}/history", LIST(FILE)) == []
            assert await c.ok("GET", f"{w}/sessions/{sid}/filetracker/files", LIST(STR)) == []
            await c.ok(
                "POST", w + "/current-session", query={"client_id": c.client_id},
                body={"session_id": sid},
            )  # fmt: skip
            # Another client without an event stream may not claim a current session.
            r = await c.send(
                "POST", w + "/current-session", query={"client_id": str(uuid.uuid4())},
                body={"session_id": sid},
            )  # fmt: skip
            assert r.status_code == 409, r.text
            # AgentRun: SendMessage without a RunID. The write tool asks; the dialog reads
            # WritePermissionsParams.file_path; GrantPermission sends the whole request back.
            r = await c.send("POST", w + "/agent", body={"session_id": sid, "prompt": "write"})
            assert r.status_code == 202
            seen = await events.until(lambda k, p: k == "permission_request")
            request = seen[-1][1]
            params = decoded(request["params"], WRITE_PERMISSION_PARAMS)
            assert params["file_path"] == str(project / "notes.txt")
            granted = await c.ok(
                "POST", w + "/permissions/grant", {"resolved": BOOL},
                body={"permission": request, "action": "allow"},
            )  # fmt: skip
            assert granted["resolved"] is True
            await events.until(lambda k, p: k == "run_complete" and p["session_id"] == sid)
            assert (project / "notes.txt").read_text() == "hello"
            # The up-arrow history: ListUserMessages of the session, and of the workspace.
            mine = await c.ok("GET", f"{w}/sessions/{sid}/messages/user", LIST(MESSAGE))
            assert [m["role"] for m in mine] == ["user"]
            assert await c.ok("GET", w + "/messages/user", LIST(MESSAGE)) == mine
            await c.ok("GET", f"{w}/sessions/{sid}/messages", LIST(MESSAGE))
            # Busy: a prompt parked mid-stream; AgentIsSessionBusy → GetAgentSessionInfo.
            r = await c.send("POST", w + "/agent", body={"session_id": sid, "prompt": "long"})
            assert r.status_code == 202
            await gate.reached.wait()
            busy = await c.ok("GET", f"{w}/agent/sessions/{sid}", SESSION)
            assert busy["is_busy"] is True
            assert busy["id"] == sid
            assert (await c.ok("GET", w + "/agent", AGENT_INFO))["is_busy"] is True
            queued = await c.ok("GET", f"{w}/agent/sessions/{sid}/prompts/queued", INT)
            assert queued == 0
            # Esc: CancelAgentSession, no body.
            await c.ok("POST", f"{w}/agent/sessions/{sid}/cancel")
            gate.release()
            seen = await events.until(
                lambda k, p: (
                    k == "message"
                    and p["role"] == "assistant"
                    and any(
                        part["type"] == "finish" and part["data"]["reason"] == "canceled"
                        for part in p["parts"]
                    )
                )
            )
            idle = await c.ok("GET", f"{w}/agent/sessions/{sid}", SESSION)
            assert idle["is_busy"] is False
            assert events.undecodable == []
            # Back to the landing screen, then Shutdown → RetireClient.
            await c.ok(
                "POST", w + "/current-session", query={"client_id": c.client_id},
                body={"session_id": ""},
            )  # fmt: skip
            await c.ok("DELETE", f"/clients/{c.client_id}")
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("event", "problem"),
    [
        ({"type": "error", "message": "a string"}, "$.message"),
        ({"type": "error", "message": {"id": "m", "parts": "x"}}, "$.message.parts"),
        ({"type": "error", "done": "yes"}, "$.done"),
    ],
)
def test_the_go_decoding_check_catches_what_crush_drops(event: Any, problem: str) -> None:
    """The check above is not vacuous: the shapes that made Crush drop an agent_event fail it."""
    errors = go_decode_errors(event, AGENT_EVENT)
    assert errors
    assert errors[0].startswith(problem)
