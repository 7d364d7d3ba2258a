"""The OpenAPI 3.1 description of the ``/v1`` API, built from the wire types.

The shapes come from the attrs classes of :mod:`crush_trio.wire` (field names, types, defaults and
the part wrapper the one converter writes); this module adds only what the types cannot say: the
route table (method, path, body, answer and status codes, as in docs/protocol.md section 4) and
the envelope of events and websocket frames. ``tests/test_openapi.py`` checks that every route of
the application has an entry here and every entry a route.
"""

from __future__ import annotations

import enum
import functools
import html
import types
import typing
from typing import Any, Final, Literal

import attrs

from .. import __version__, wire

#: The document's OpenAPI version.
OPENAPI_VERSION: Final = "3.1.0"

_REF: Final = "#/components/schemas/"


class _Schemas:
    """JSON Schemas of wire types, each attrs class and enum once, as a component."""

    def __init__(self) -> None:
        self.components: dict[str, Any] = {}

    def ref(self, name: str) -> dict[str, Any]:
        return {"$ref": _REF + name}

    def of(self, tp: Any) -> dict[str, Any]:
        if tp is Any or tp is object:
            return {}
        if tp is type(None):
            return {"type": "null"}
        if tp is str:
            return {"type": "string"}
        if tp is bool:
            return {"type": "boolean"}
        if tp is int:
            return {"type": "integer"}
        if tp is float:
            return {"type": "number"}
        if tp is wire.Part:
            return self._part()
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if origin is Literal:
            return {"type": "string", "enum": list(args)}
        if origin in (typing.Union, types.UnionType):
            members = [self.of(a) for a in args]
            non_null = [a for a in args if a is not type(None)]
            if len(non_null) == 1 and len(args) == 2:
                inner = members[0] if args[0] is not type(None) else members[1]
                if set(inner) == {"type"} and isinstance(inner["type"], str):
                    return {"type": [inner["type"], "null"]}
            return {"anyOf": members}
        if origin in (list, tuple):
            return {"type": "array", "items": self.of(args[0]) if args else {}}
        if origin is dict:
            return {
                "type": "object",
                "additionalProperties": self.of(args[1]) if len(args) == 2 else {},
            }
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            name = tp.__name__
            if name not in self.components:
                self.components[name] = {"type": "string", "enum": [m.value for m in tp]}
            return self.ref(name)
        if isinstance(tp, type) and attrs.has(tp):
            return self.attrs_class(tp)
        raise TypeError(f"no JSON Schema for {tp!r}")

    def attrs_class(self, cls: type[Any], name: str | None = None) -> dict[str, Any]:
        name = name or cls.__name__
        if name in self.components:
            return self.ref(name)
        self.components[name] = {}  # placeholder against recursion
        hints = typing.get_type_hints(cls, vars(wire))
        properties: dict[str, Any] = {}
        required: list[str] = []
        for field in attrs.fields(cls):
            schema = dict(self.of(hints[field.name]))
            if field.default is attrs.NOTHING:
                required.append(field.name)
            elif not isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
                default = field.default
                schema["default"] = default.value if isinstance(default, enum.Enum) else default
            properties[field.name] = schema
        body: dict[str, Any] = {"type": "object", "properties": properties}
        if required:
            body["required"] = required
        doc = (cls.__doc__ or "").strip()
        if doc and not doc.startswith(cls.__name__ + "("):
            body["description"] = doc.split("\n\n")[0].replace("\n", " ")
        self.components[name] = body
        return self.ref(name)

    def _part(self) -> dict[str, Any]:
        if "Part" not in self.components:
            variants = []
            for cls, tag in wire.PART_TAGS.items():
                variant_name = cls.__name__ + "Wrapper"
                self.components[variant_name] = {
                    "type": "object",
                    "properties": {
                        "type": {"const": tag},
                        "data": self.attrs_class(cls),
                    },
                    "required": ["type", "data"],
                }
                variants.append(self.ref(variant_name))
            self.components["Part"] = {
                "description": "A message part, as the wire wraps it: {type, data}.",
                "oneOf": variants,
                "discriminator": {
                    "propertyName": "type",
                    "mapping": {
                        tag: _REF + cls.__name__ + "Wrapper" for cls, tag in wire.PART_TAGS.items()
                    },
                },
            }
        return self.ref("Part")


@attrs.define
class Route:
    """One operation: what it takes and answers (docs/protocol.md section 4)."""

    method: str
    path: str
    summary: str
    response: Any = None  # a wire type, or a JSON Schema dict
    status: int = 200
    body: Any = None
    query: list[tuple[str, dict[str, Any], bool]] = attrs.field(factory=list)
    errors: tuple[int, ...] = ()
    tag: str = "system"
    content_type: str = "application/json"
    auth: bool = True
    extra: dict[str, Any] = attrs.field(factory=dict)


_EMPTY: Final = {"type": "object", "maxProperties": 0, "description": "Nothing to return: {}"}
_CLIENT_ID: Final = ("client_id", {"type": "string", "format": "uuid"}, True)
_DELTAS: Final = ("deltas", {"type": "string", "enum": ["0", "1"]}, False)
#: ``batch=1``: a websocket frame may carry several envelopes, one per line.
_BATCH: Final = ("batch", {"type": "string", "enum": ["0", "1"]}, False)
_SINCE: Final = ("since", {"type": "string", "pattern": "^[0-9]+$"}, False)
_LIMIT: Final = ("limit", {"type": "string", "pattern": "^[0-9]+$"}, False)
_BEFORE: Final = ("before", {"type": "string"}, False)
_AFTER: Final = ("after", {"type": "string"}, False)
_QUERY: Final = ("q", {"type": "string"}, False)
_STATUS: Final = ("status", {"type": "string"}, False)
_SESSION_ID: Final = ("session_id", {"type": "string"}, False)


#: Path prefixes: a workspace, one of its sessions, and that session as the agent sees it.
_W: Final = "/v1/workspaces/{wid}"
_S: Final = _W + "/sessions/{sid}"
_A: Final = _W + "/agent/sessions/{sid}"


def routes() -> list[Route]:
    """Every route of the application (docs/protocol.md section 4), in the document's order."""
    return [*_server_routes(), *_session_routes(), *_change_routes()]


def _server_routes() -> list[Route]:
    """The server's own routes, workspaces, configuration and models."""
    w = _W
    return [
        Route("GET", "/v1/health", "Liveness (no token needed)", {"$ref": _REF + "Health"},
              auth=False),
        Route("GET", "/v1/version", "Server version", {"$ref": _REF + "Version"}),
        Route("GET", "/v1/openapi.json", "This document", {"type": "object"}),
        Route("GET", "/v1/docs", "This document as an HTML page", content_type="text/html"),
        Route("GET", "/metrics", "Prometheus metrics, text format 0.0.4 (docs/operations.md)",
              content_type="text/plain"),
        Route("POST", "/v1/control", "Shut the server down", _EMPTY, body=wire.ControlRequest,
              errors=(409,)),
        Route("DELETE", "/v1/clients/{client_id}", "Retire a client id everywhere", _EMPTY),
        Route("POST", "/v1/workspaces", "Open (or join) a workspace", wire.Workspace,
              body=wire.CreateWorkspaceRequest, errors=(409, 429, 503), tag="workspaces"),
        Route("GET", "/v1/workspaces", "Open workspaces", list[wire.Workspace],
              tag="workspaces"),
        Route("GET", w, "One workspace", wire.Workspace, tag="workspaces"),
        Route("DELETE", w, "Release a client's hold", _EMPTY, query=[_CLIENT_ID],
              tag="workspaces"),
        Route("POST", w + "/current-session", "The session a client shows (\"\": none)",
              _EMPTY, body=wire.CurrentSessionRequest, query=[_CLIENT_ID], errors=(409,),
              tag="workspaces"),
        Route("GET", w + "/config", "The configuration in use, in Crush's shape (no secrets)",
              wire.WorkspaceConfig, tag="models"),
        Route("GET", w + "/providers", "Providers and the models each offers",
              list[wire.CatalogProvider], tag="models"),
        Route("POST", w + "/config/model", "Use a model for the large or small role",
              _EMPTY, body=wire.SelectModelRequest, errors=(409,), tag="models"),
        Route("GET", w + "/agent/default-small-model", "The small model of a provider",
              wire.ModelChoice, query=[("provider_id", {"type": "string"}, True)],
              tag="models"),
        Route("GET", w + "/project/needs-init", "Whether Crush's project setup is due "
              "(always false)", wire.NeedsInit, tag="workspaces"),
        Route("POST", w + "/trust", "Trust the workspace's own config files (or stop)",
              wire.TrustResult, body=wire.TrustRequest, errors=(409,), tag="workspaces"),
    ]  # fmt: skip


def _session_routes() -> list[Route]:
    """Sessions, their messages, the agent and runs."""
    w, s, a = _W, _S, _A
    return [
        Route("POST", w + "/sessions", "Create a session", wire.Session,
              body=wire.CreateSessionRequest, errors=(409,), tag="sessions"),
        Route("GET", w + "/sessions", "Sessions, most recently updated first (with a paging "
              "parameter: newest created first, one page)", list[wire.Session],
              query=[_LIMIT, _BEFORE, _QUERY], tag="sessions"),
        Route("GET", s, "One session", wire.Session, tag="sessions"),
        Route("PATCH", s, "Rename a session", wire.Session, body=wire.UpdateSessionRequest,
              tag="sessions"),
        Route("PUT", s, "Rename a session (Crush's SaveSession: the whole session is sent, "
              "only its title is used)", wire.Session, body=wire.UpdateSessionRequest,
              tag="sessions"),
        Route("DELETE", s, "Delete a session (its runs are cancelled first)", _EMPTY,
              tag="sessions"),
        Route("GET", s + "/messages", "A session's messages, oldest first (paged with limit, "
              "before or after)", list[wire.Message], query=[_LIMIT, _BEFORE, _AFTER],
              tag="sessions"),
        Route("GET", s + "/messages/user", "A session's user messages, oldest first",
              list[wire.Message], tag="sessions"),
        Route("GET", w + "/messages/user", "Every session's user messages",
              list[wire.Message], tag="sessions"),
        Route("GET", s + "/history", "File versions the session wrote (none kept yet)",
              list[wire.HistoryFile], tag="sessions"),
        Route("GET", s + "/filetracker/files", "Files the session read (not tracked: [])",
              list[str], tag="sessions"),
        Route("GET", w + "/agent", "Agent state", wire.AgentInfo, tag="agent"),
        Route("POST", w + "/agent/init", "Get the agent ready (it is once the workspace is "
              "open)", _EMPTY, body=wire.AgentInitRequest, errors=(409,), tag="agent"),
        Route("POST", w + "/agent/update", "Reload the agent's models (they apply at once)",
              _EMPTY, errors=(409,), tag="agent"),
        Route("GET", a, "One session, with is_busy", wire.Session, tag="agent"),
        Route("POST", w + "/agent", "Send a prompt: accepted once its run record is stored",
              wire.AcceptedPrompt, status=202, body=wire.AgentMessage, errors=(409, 429),
              tag="agent"),
        Route("POST", a + "/cancel", "Cancel the session's turn and queue", _EMPTY,
              tag="agent"),
        Route("POST", a + "/summarize", "Summarize the session", wire.Session,
              errors=(409, 502), tag="agent"),
        Route("GET", a + "/prompts/queued", "Number of queued prompts", {"type": "integer"},
              tag="agent"),
        Route("GET", a + "/prompts/list", "Queued prompt texts, oldest first",
              list[str], tag="agent"),
        Route("POST", a + "/prompts/clear", "Drop the queued prompts", _EMPTY, tag="agent"),
        Route("GET", w + "/runs/{run_id}", "One run", wire.Run, tag="agent"),
        Route("POST", w + "/runs/{run_id}/cancel", "Cancel one run",
              {"$ref": _REF + "CancelResult"}, tag="agent"),
    ]  # fmt: skip


def _change_routes() -> list[Route]:
    """What runs changed, permissions, the event streams and the browser client."""
    w, s = _W, _S
    return [
        Route("GET", w + "/runs", "Run records, newest first (paged: docs/protocol.md "
              "\"Paging\")", list[wire.Run], query=[_LIMIT, _BEFORE, _STATUS, _SESSION_ID],
              errors=(400,), tag="changes"),
        Route("GET", w + "/runs/{run_id}/diff", "What one run (or revert) changed",
              wire.Diff, errors=(409,), tag="changes"),
        Route("POST", w + "/runs/{run_id}/revert", "Put back the files a run changed",
              wire.RevertResult, body=wire.RevertRequest, errors=(409,), tag="changes"),
        Route("GET", w + "/reverts/{revert_id}", "A revert's recorded outcome",
              wire.RevertResult, tag="changes"),
        Route("GET", s + "/diff", "What a session's runs changed, together", wire.Diff,
              errors=(409,), tag="changes"),
        Route("POST", s + "/fork", "A new session with the history up to a message",
              wire.ForkResult, status=201, body=wire.ForkRequest, errors=(400, 409),
              tag="changes"),
        Route("GET", s + "/export", "A session as one JSON or Markdown document",
              {"type": "object"}, query=[("format", {"type": "string",
                                                     "enum": ["json", "markdown"]}, False)],
              errors=(400,), tag="changes"),
        Route("POST", w + "/permissions/grant", "Answer a permission request",
              {"$ref": _REF + "GrantResult"}, body=wire.GrantRequest, tag="permissions"),
        Route("GET", w + "/permissions", "Permission requests waiting for an answer",
              list[wire.PermissionRequest], tag="permissions"),
        Route("GET", w + "/permissions/skip", "Whether everything is approved",
              wire.SkipState, tag="permissions"),
        Route("POST", w + "/permissions/skip", "Approve everything in the workspace", _EMPTY,
              body=wire.SkipRequest, tag="permissions"),
        Route("GET", w + "/events", "Server-sent events (section 6)",
              content_type="text/event-stream", query=[_CLIENT_ID, _DELTAS, _SINCE],
              errors=(409,), tag="events",
              extra={"x-event-schema": {"$ref": _REF + "Frame"}}),
        Route("GET", w + "/ws", "Event websocket: one Frame per text frame (with batch=1, "
              "one Frame per line for the events written together), takes Command frames "
              "(sections 6 and 7)",
              status=101, content_type="",
              query=[_CLIENT_ID, _DELTAS, _SINCE, _BATCH], errors=(409,), tag="events",
              extra={"x-websocket": {"receive": {"$ref": _REF + "WsServerFrame"},
                                     "send": {"$ref": _REF + "Command"}}}),
        Route("GET", "/", "The browser client", content_type="text/html", tag="web",
              extra={"x-token-exchange": "?token= answers 303 with the token cookie"}),
        Route("GET", "/static/{name}", "A file of the browser client",
              content_type="application/octet-stream", tag="web"),
    ]  # fmt: skip


#: Test-only routes (``CRUSH_TRIO_DEBUG_ROUTES=1``), left out of the document.
DEBUG_ROUTES: Final = frozenset({("POST", "/v1/workspaces/{wid}/debug/drop-streams")})


def _event_components(sch: _Schemas) -> None:
    """The event envelope per payload type, the connection frames and the websocket frames."""
    _frame_components(sch)
    _websocket_components(sch)


def _frame_components(sch: _Schemas) -> None:
    """What an event stream carries: one envelope per payload type, ``hello`` and ``gap``."""
    c = sch.components
    c["EventKind"] = {"type": "string", "enum": [k.value for k in wire.EventKind]}
    variants = []
    for cls, ptype in wire.PAYLOAD_TYPES.items():
        name = "Event_" + ptype.value
        c[name] = {
            "type": "object",
            "description": f"A {ptype.value} event"
            + (" (must-deliver)" if ptype.must_deliver else " (lossy)"),
            "properties": {
                "seq": {"type": "integer", "minimum": 1},
                "type": {"const": ptype.value},
                "payload": {
                    "type": "object",
                    "properties": {"type": sch.ref("EventKind"), "payload": sch.of(cls)},
                    "required": ["type", "payload"],
                },
            },
            "required": ["seq", "type", "payload"],
        }
        variants.append(sch.ref(name))
    c["Hello"] = {
        "type": "object",
        "description": "The first frame of every event stream (repeats the latest seq).",
        "properties": {
            "seq": {"type": "integer", "minimum": 0},
            "type": {"const": "hello"},
            "payload": {
                "type": "object",
                "properties": {
                    "workspace_id": {"type": "string"},
                    "server_version": {"type": "string"},
                },
                "required": ["workspace_id", "server_version"],
            },
        },
        "required": ["seq", "type", "payload"],
    }
    c["Gap"] = {
        "type": "object",
        "description": "Events this client missed; re-read state over HTTP.",
        "properties": {
            "seq": {"type": "integer", "minimum": 0},
            "type": {"const": "gap"},
            "payload": {
                "type": "object",
                "properties": {
                    "dropped": {"type": "integer", "minimum": 0},
                    "from_seq": {"type": "integer", "minimum": 0},
                    "to_seq": {"type": "integer", "minimum": 0},
                },
                "required": ["dropped", "from_seq", "to_seq"],
            },
        },
        "required": ["seq", "type", "payload"],
    }
    c["Event"] = {"oneOf": variants}
    c["Frame"] = {
        "description": "One frame of an event stream: an event, hello or gap.",
        "oneOf": [sch.ref("Event"), sch.ref("Hello"), sch.ref("Gap")],
    }


def _websocket_components(sch: _Schemas) -> None:
    """The websocket's own frames: commands, their replies and the error frame."""
    c = sch.components
    c["Command"] = sch.of(wire.WsCommand)
    methods = {
        "agent.prompt": wire.AgentMessage,
        "agent.cancel": wire.SessionRef,
        "agent.clear_queue": wire.SessionRef,
        "sessions.create": wire.CreateSessionRequest,
        "sessions.summarize": wire.SessionRef,
        "messages.list": wire.SessionRef,
        "runs.get": wire.RunRef,
        "runs.cancel": wire.RunRef,
        "permissions.grant": wire.GrantRequest,
    }
    c["Command"] = {
        "type": "object",
        "description": "A websocket command; params per method in x-params.",
        "properties": {
            "id": {},
            "method": {"type": "string", "enum": sorted([*methods, "sessions.list"])},
            "params": {"type": "object", "default": {}},
        },
        "required": ["method"],
        "x-params": {m: sch.of(cls) for m, cls in sorted(methods.items())},
    }
    c["ReplyOk"] = {
        "type": "object",
        "properties": {
            "type": {"const": "reply"},
            "id": {},
            "ok": {"const": True},
            "result": {},
        },
        "required": ["type", "id", "ok", "result"],
    }
    c["ReplyError"] = {
        "type": "object",
        "properties": {
            "type": {"const": "reply"},
            "id": {},
            "ok": {"const": False},
            "status": {"type": "integer"},
            "message": {"type": "string"},
        },
        "required": ["type", "id", "ok", "status", "message"],
    }
    c["ErrorFrame"] = {
        "type": "object",
        "properties": {"type": {"const": "error"}, "message": {"type": "string"}},
        "required": ["type", "message"],
    }
    c["WsServerFrame"] = {
        "oneOf": [sch.ref("Frame"), sch.ref("ReplyOk"), sch.ref("ReplyError"),
                  sch.ref("ErrorFrame")]
    }  # fmt: skip


_STATUS_TEXT: Final = {
    101: "Switching to the websocket",
    400: "Bad input (the message names the JSON path)",
    401: "Token missing or wrong",
    403: "Foreign Origin or cross-site request",
    404: "Unknown id in the path",
    408: "The request head or body did not arrive in time",
    409: "Conflict (workspace closing, client retired, busy, not idle)",
    413: "Body over server.max_body_bytes",
    415: "Body is not application/json",
    421: "Host not allowed",
    431: "Request head over 16 KiB",
    429: "A configured bound is reached",
    500: "A bug",
    502: "The model failed",
    503: "Server shutting down",
}


def _operation(sch: _Schemas, route: Route) -> dict[str, Any]:
    op: dict[str, Any] = {
        "operationId": _operation_id(route),
        "summary": route.summary,
        "tags": [route.tag],
    }
    params = [
        {"name": name, "in": "path", "required": True, "schema": _PATH_PARAMS.get(name, _STR)}
        for name in _path_params(route.path)
    ]
    params += [
        {"name": name, "in": "query", "required": req, "schema": schema}
        for name, schema, req in route.query
    ]
    if params:
        op["parameters"] = params
    if route.body is not None:
        op["requestBody"] = {
            "required": bool(attrs.has(route.body) and _required_fields(route.body)),
            "content": {"application/json": {"schema": sch.of(route.body)}},
        }
    ok: dict[str, Any] = {"description": "OK"}
    if route.content_type == "application/json":
        schema = route.response if isinstance(route.response, dict) else sch.of(route.response)
        ok["content"] = {"application/json": {"schema": schema}}
    elif route.content_type:
        ok["content"] = {route.content_type: {"schema": {"type": "string"}}}
    if route.status == 101:
        ok["description"] = _STATUS_TEXT[101]
    responses: dict[str, Any] = {str(route.status): ok}
    # Every request: a malformed or slow head (the connection dispatcher, docs/protocol.md
    # section 2), the Host allow-list, and a bug.
    codes = {400, 408, 421, 431, 500}
    if route.auth:
        codes.add(401)
    if route.method in ("POST", "PUT", "PATCH", "DELETE"):
        codes |= {403, 415}
        if route.body is not None:
            codes.add(413)
    if _path_params(route.path) or route.query:
        codes |= {404}
    if route.path.endswith(("/events", "/ws")):
        codes.add(403)
    if route.path == "/":
        codes.add(303)
    codes |= set(route.errors)
    for code in sorted(codes):
        if code == 303:
            responses["303"] = {"description": "Token traded for a cookie; see Location"}
            continue
        responses[str(code)] = {"$ref": f"#/components/responses/Error{code}"}
    op["responses"] = responses
    if not route.auth:
        op["security"] = []
    op.update(route.extra)
    return op


_STR: Final = {"type": "string"}
_PATH_PARAMS: Final = {"client_id": {"type": "string", "format": "uuid"}}


def _required_fields(cls: type[Any]) -> list[str]:
    return [f.name for f in attrs.fields(cls) if f.default is attrs.NOTHING]


def _path_params(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{")]


def _operation_id(route: Route) -> str:
    words = [p.strip("{}") for p in route.path.strip("/").split("/") if p and p != "v1"]
    return route.method.lower() + "_" + "_".join(words or ["index"]).replace(".", "_")


@functools.cache
def document() -> dict[str, Any]:
    """The OpenAPI 3.1 document (built once; treat it as read-only)."""
    sch = _Schemas()
    c = sch.components
    c["Error"] = {
        "type": "object",
        "description": "Every error: what went wrong and what to do.",
        "properties": {"message": {"type": "string"}},
        "required": ["message"],
    }
    c["Health"] = {
        "type": "object",
        "properties": {"status": {"const": "ok"}},
        "required": ["status"],
    }
    c["Version"] = {
        "type": "object",
        "properties": {"version": {"type": "string"}},
        "required": ["version"],
    }
    c["CancelResult"] = {
        "type": "object",
        "properties": {"cancelled": {"type": "boolean"}},
        "required": ["cancelled"],
    }
    c["GrantResult"] = {
        "type": "object",
        "properties": {"resolved": {"type": "boolean"}},
        "required": ["resolved"],
    }
    paths: dict[str, Any] = {}
    for route in routes():
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(sch, route)
    _event_components(sch)
    for cls in wire.PAYLOAD_TYPES:
        sch.of(cls)
    responses = {
        f"Error{code}": {
            "description": text,
            "content": {"application/json": {"schema": sch.ref("Error")}},
        }
        for code, text in _STATUS_TEXT.items()
        if code != 101
    }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "crush_trio",
            "version": __version__,
            "description": "The crush_trio server's /v1 API (docs/protocol.md).",
        },
        "paths": paths,
        "components": {
            "schemas": dict(sorted(c.items())),
            "responses": responses,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "query": {"type": "apiKey", "in": "query", "name": "token"},
            },
        },
        "security": [{"bearer": []}, {"query": []}],
    }


def docs_page() -> str:
    """A plain HTML page listing the operations (no script, nothing from elsewhere)."""
    doc = document()
    rows = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            codes = ", ".join(op["responses"])
            rows.append(
                f"<tr><td><code>{method.upper()}</code></td><td><code>{html.escape(path)}"
                f"</code></td><td>{html.escape(op['summary'])}</td><td>{codes}</td></tr>"
            )
    names = ", ".join(f"<code>{html.escape(n)}</code>" for n in doc["components"]["schemas"])
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>crush_trio API</title>"
        "</head><body><h1>crush_trio API " + html.escape(doc["info"]["version"]) + "</h1>"
        "<p>The machine-readable document is <a href='/v1/openapi.json'>/v1/openapi.json</a> "
        "(OpenAPI " + OPENAPI_VERSION + "); docs/protocol.md explains every route.</p>"
        "<table><tr><th>Method</th><th>Path</th><th>What</th><th>Statuses</th></tr>"
        + "".join(rows)
        + "</table><h2>Schemas</h2><p>"
        + names
        + "</p></body></html>"
    )
