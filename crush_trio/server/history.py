"""What a workspace's runs did: diffs, reverts, forks, paged lists and exports.

``GET .../runs/{id}/diff``, ``GET .../sessions/{sid}/diff``, ``POST .../runs/{id}/revert``,
``GET .../reverts/{revert_id}``, ``POST .../sessions/{sid}/fork``, ``GET .../runs`` (paged) and
``GET .../sessions/{sid}/export``; paging of ``GET .../sessions`` and ``GET .../messages`` is
answered here too when a paging parameter is given (docs/protocol.md "Changes" and "Paging").
The operations are in :class:`History`; :mod:`.routes.changes` adds their routes to the app.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import attrs
from quart import Response

from .. import wire
from ..changes import RevertConflict
from ..defaults import DEFAULT_PAGE
from ..errors import BadRequest, Conflict, NotFound
from ..store.paging import MAX_PAGE, CursorNotFound, PageQuery
from ..wire import (
    Diff,
    FileChange,
    ForkRequest,
    ForkResult,
    Message,
    RevertRequest,
    RevertResult,
    Role,
    Run,
    RunStatus,
    Session,
    ToolCallPart,
    ToolResultPart,
    new_id,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ..backend.workspace import Workspace
    from .api import Api

#: Bound on the messages a fork copies and an export holds (a longer session: 413-like 400).
MAX_EXPORT_MESSAGES: Final = 20_000
#: Bound on the runs a session diff or a fork's revert walks.
MAX_SESSION_RUNS: Final = 10_000

_PAGING_KEYS: Final = frozenset({"limit", "before", "after", "q"})


def parse_page(args: Mapping[str, str], *, what: str) -> PageQuery:
    """The paging parameters of a list request (``limit``, ``before``, ``after``, ``q``,
    ``status``, ``session_id``); :class:`BadRequest` naming the bad one."""
    raw_limit = args.get("limit")
    limit = DEFAULT_PAGE
    if raw_limit is not None:
        if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_PAGE:
            raise BadRequest(f"limit {raw_limit!r} is not a number from 1 to {MAX_PAGE}")
        limit = int(raw_limit)
    before, after = args.get("before"), args.get("after")
    if before is not None and after is not None:
        raise BadRequest(f"{what}: give 'before' or 'after', not both")
    statuses: tuple[str, ...] = ()
    if args.get("status"):
        values = tuple(s for s in args["status"].split(",") if s)
        allowed = {s.value for s in RunStatus}
        bad = [s for s in values if s not in allowed]
        if bad:
            raise BadRequest(f"status {bad[0]!r} is not one of {', '.join(sorted(allowed))}")
        statuses = values
    return PageQuery(
        limit=limit,
        before=before or None,
        after=after or None,
        query=args.get("q", "")[:200],
        statuses=statuses,
        session_id=args.get("session_id") or None,
    )


def wants_page(args: Mapping[str, str]) -> bool:
    return any(key in args for key in _PAGING_KEYS)


class History:
    """Diffs, reverts, forks, pages and exports of one server's workspaces."""

    def __init__(self, api: Api) -> None:
        self.api = api

    # -- runs

    async def run(self, ws: Workspace, run_id: str) -> Run:
        """A run record with the files it changed."""
        run = await self.api.get_run(ws, run_id)
        return await self.decorate(ws, run)

    @staticmethod
    async def decorate(ws: Workspace, run: Run) -> Run:
        if run.status.terminal and not run.files:
            record = await ws.changes.record(run.run_id)
            if record is not None:
                run = attrs.evolve(run, files=list(record.files))
        return run

    async def list_runs(self, ws: Workspace, page: PageQuery) -> list[Run]:
        try:
            runs = await ws.store.page_runs(page)
        except CursorNotFound:
            raise BadRequest(f"before {page.before!r} names no run of workspace {ws.id}") from None
        return [await self.decorate(ws, ws.runs.get(r.run_id) or r) for r in runs]

    async def run_diff(self, ws: Workspace, run_id: str) -> Diff:
        if not ws.changes.enabled:
            raise Conflict(ws.changes.error or "change tracking is off for this workspace")
        record = await ws.changes.record(run_id)
        if record is None:
            run = ws.runs.get(run_id) or await ws.store.get_run(run_id)
            if run is not None and not run.status.terminal:
                return Diff([], "", run_id=run_id, session_id=run.session_id)
        return await ws.changes.run_diff(run_id)

    async def session_diff(self, ws: Workspace, session_id: str) -> Diff:
        await self.api.get_session(ws, session_id)
        if not ws.changes.enabled:
            raise Conflict(ws.changes.error or "change tracking is off for this workspace")
        return await ws.changes.session_diff(session_id)

    async def revert(self, ws: Workspace, run_id: str, body: RevertRequest) -> RevertResult:
        """Revert one run (or revert): 409 while its session runs, or on a conflict."""
        ws.check_open()
        record = await ws.changes.record(run_id)
        session_id = record.session_id if record is not None else None
        if record is None:
            run = ws.runs.get(run_id) or await ws.store.get_run(run_id)
            if run is None:
                raise NotFound(f"run {run_id!r} not found in workspace {ws.id}")
            if not run.status.terminal:
                raise Conflict(f"run {run_id} is still {run.status.value}; wait for its end")
            session_id = run.session_id
        if session_id is not None and ws.agent.is_busy(session_id):
            raise Conflict(
                f"session {session_id} has a run in progress; cancel it or wait for its end "
                "before reverting"
            )
        return await ws.changes.revert(run_id, force=body.force)

    async def revert_record(self, ws: Workspace, revert_id: str) -> RevertResult:
        result = await ws.changes.revert_record(revert_id)
        if result is None:
            raise NotFound(f"revert {revert_id!r} not found in workspace {ws.id}")
        return result

    # -- fork

    async def fork(self, ws: Workspace, session_id: str, body: ForkRequest) -> ForkResult:
        """A new session holding the history up to ``message_id`` (with the tool results that
        answer its tool calls), ``parent_session_id`` set; optionally revert later runs."""
        ws.check_open()
        source = await self.api.get_session(ws, session_id)
        messages = await self.api.list_messages(ws, session_id)
        if len(messages) > MAX_EXPORT_MESSAGES:
            raise BadRequest(f"session has more than {MAX_EXPORT_MESSAGES} messages to fork")
        cut = next((i for i, m in enumerate(messages) if m.id == body.message_id), None)
        if cut is None:
            raise BadRequest(
                f"message {body.message_id!r} is not in session {session_id}; list its "
                f"messages with GET /v1/workspaces/{ws.id}/sessions/{session_id}/messages"
            )
        keep = messages[: cut + 1]
        calls = {p.id for p in messages[cut].parts if isinstance(p, ToolCallPart)}
        for later in messages[cut + 1 :]:
            answered = {p.tool_call_id for p in later.parts if isinstance(p, ToolResultPart)}
            if later.role is not Role.TOOL or not answered & calls:
                break
            keep.append(later)
        reverts: list[RevertResult] = []
        if body.revert_files:
            if ws.agent.is_busy(session_id):
                raise Conflict(f"session {session_id} has a run in progress; wait for its end")
            reverts = await self._revert_after(
                ws, session_id, {m.id for m in messages[len(keep) :]}
            )
        fork = Session(
            new_id(),
            title=f"{source.title or 'Session'} (fork)",
            parent_session_id=session_id,
        )
        await ws.store.create_session(fork)
        ids = {m.id: new_id() for m in keep}
        copies = [
            Message(
                ids[m.id],
                fork.id,
                m.role,
                list(m.parts),
                m.model,
                m.provider,
                m.created_at,
                m.updated_at,
                m.is_summary_message,
            )
            for m in keep
        ]
        if copies:
            await ws.store.write_messages(copies)
        if source.summary_message_id in ids:  # later requests start from the copied summary
            await ws.store.set_summary(fork.id, ids[source.summary_message_id], 0, 0.0)
        stored = await self.api.get_session(ws, fork.id)
        ws.broker.publish(stored, wire.EventKind.CREATED)
        return ForkResult(stored, len(copies), reverts)

    async def _revert_after(
        self, ws: Workspace, session_id: str, later_messages: set[str]
    ) -> list[RevertResult]:
        """Revert, newest first, the session's runs whose reply comes after the fork point."""
        runs = await ws.store.page_runs(PageQuery(limit=MAX_SESSION_RUNS, session_id=session_id))
        results = []
        for run in runs:  # newest first
            if run.message_id not in later_messages:
                continue
            if await ws.changes.record(run.run_id) is None:
                continue
            try:
                results.append(await ws.changes.revert(run.run_id))
            except RevertConflict as exc:
                raise RevertConflict(
                    f"forking with revert_files stopped at run {run.run_id}: {exc.message}",
                    exc.files,
                ) from None
        return results

    # -- pages and exports

    async def sessions_page(self, ws: Workspace, page: PageQuery) -> list[Session]:
        try:
            sessions = await ws.store.page_sessions(page)
        except CursorNotFound:
            raise BadRequest(
                f"before {page.before!r} names no session of workspace {ws.id}"
            ) from None
        return [ws.decorate(s) for s in sessions]

    async def messages_page(self, ws: Workspace, session_id: str, page: PageQuery) -> list[Message]:
        await self.api.get_session(ws, session_id)
        await ws.messages.flush_session(session_id)
        try:
            return await ws.store.page_messages(session_id, page)
        except CursorNotFound:
            cursor = page.after or page.before
            raise BadRequest(
                f"cursor {cursor!r} names no message of session {session_id}"
            ) from None

    async def export(self, ws: Workspace, session_id: str, fmt: str) -> Response:
        if fmt not in ("json", "markdown"):
            raise BadRequest(f"format {fmt!r} is not 'json' or 'markdown'")
        session = await self.api.get_session(ws, session_id)
        messages = await self.api.list_messages(ws, session_id)
        if len(messages) > MAX_EXPORT_MESSAGES:
            raise BadRequest(f"session has more than {MAX_EXPORT_MESSAGES} messages to export")
        runs = [
            await self.decorate(ws, r)
            for r in reversed(
                await ws.store.page_runs(PageQuery(limit=MAX_SESSION_RUNS, session_id=session_id))
            )
        ]
        if fmt == "json":
            body = wire.dumps({"session": session, "messages": messages, "runs": runs})
            response = Response(body, content_type="application/json")
        else:
            text = export_markdown(session, messages, runs)
            response = Response(text.encode(), content_type="text/markdown; charset=utf-8")
        name = f"session-{session_id}.{'json' if fmt == 'json' else 'md'}"
        response.headers["Content-Disposition"] = f'attachment; filename="{name}"'
        return response


def export_markdown(session: Session, messages: list[Message], runs: list[Run]) -> str:
    """A session as Markdown: its messages in order, then the files each run changed."""
    lines = [f"# {session.title or 'Session'}", "", f"Session `{session.id}`", ""]
    for m in messages:
        lines.append(f"## {m.role.value}")
        lines.append("")
        for part in m.parts:
            if isinstance(part, ToolCallPart):
                lines += [f"Tool call `{part.name}`:", "", "```json", part.input, "```", ""]
            elif isinstance(part, ToolResultPart):
                lines += [f"Tool result `{part.name}`:", "", "```", part.content, "```", ""]
        text = m.text()
        if text:
            lines += [text, ""]
    changed = [r for r in runs if r.files]
    if changed:
        lines += ["## Files changed", ""]
        for run in changed:
            lines.append(f"- run `{run.run_id}`:")
            lines += [f"  - {_file_line(f)}" for f in run.files]
        lines.append("")
    return "\n".join(lines)


def _file_line(f: FileChange) -> str:
    counts = "binary" if f.binary else f"+{f.added} -{f.removed}"
    return f"`{f.path}` {f.status} ({counts})"
