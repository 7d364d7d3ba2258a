"""Recovery at a workspace's opening: what a killed or stopped process left behind is ended
before any new prompt is accepted.

Runs it left ``running`` or ``queued`` end ``failed``; assistant messages it left without a finish
get an ``error`` finish, and tool calls without a result an error result. In a cluster every run
it left also ends in the event log with exactly one ``run_complete`` (see
:meth:`Recovery._complete_recovered`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import orjson

from .. import wire
from ..core.assembler import repair_tool_calls
from ..errors import Conflict
from ..wire import (
    EventKind,
    FinishPart,
    FinishReason,
    Message,
    Part,
    Role,
    Run,
    RunComplete,
    RunStatus,
    ToolResultPart,
    new_id,
    now,
)

if TYPE_CHECKING:
    from ..broker import Broker
    from ..store.protocol import WorkspaceStore

log = logging.getLogger(__name__)

STOPPED_RUN_ERROR = "server stopped before the run finished"
STOPPED_TOOL_RESULT = "Error: the server stopped before the tool call finished"
#: How far back in a cluster's event log a recovering node looks for the ``run_complete`` of a
#: terminal record not marked as logged (events).
RECOVERY_SCAN_EVENTS = 10_000


def _missing_tool_results(history: list[Message]) -> list[Message]:
    """Error results for the tool calls of ``history`` that have none (each assistant message's
    calls are answered by the tool messages that follow it, before the next other message)."""
    made: list[Message] = []
    owner: Message | None = None
    pending: dict[str, str] = {}

    def flush() -> None:
        if owner is not None and pending:
            parts: list[Part] = [
                ToolResultPart(call_id, name, STOPPED_TOOL_RESULT, is_error=True)
                for call_id, name in pending.items()
            ]
            made.append(
                Message(new_id(), owner.session_id, Role.TOOL, parts, created_at=owner.created_at)
            )

    for msg in history:
        if msg.role is Role.TOOL:
            for part in msg.parts:
                if isinstance(part, ToolResultPart):
                    pending.pop(part.tool_call_id, None)
            continue
        flush()
        owner = msg
        pending = {c.id: c.name for c in msg.tool_calls()} if msg.role is Role.ASSISTANT else {}
    flush()
    return made


class Recovery:
    """Ends what a stopped process left in a workspace's store (and, in a cluster, its event log).

    Args:
        store: the workspace's store (a cluster's store when ``event_log`` is set).
        broker: publishes the recovered ``run_complete`` events.
        event_log: the cluster's event log, or None (embedded: no events to recover).
    """

    def __init__(self, store: WorkspaceStore, broker: Broker, event_log: Any = None) -> None:
        self.store = store
        self.broker = broker
        self.event_log = event_log

    async def run(self) -> None:
        """End what a killed process left behind, before any new prompt is accepted.

        Every run it left ``running`` or ``queued`` (each one was answered 202, so each has a
        record) ends ``failed`` with :data:`STOPPED_RUN_ERROR`, saved in one transaction; each
        assistant message it left without a finish part (streaming at the kill, in any session)
        gets ``finish {"reason": "error"}``. They are failed rather than run again: a run that
        was streaming may have run tools with side effects, and one that was queued may be
        stale by now; the client sees the failure in ``GET runs/{id}`` and decides whether to
        send the prompt again (docs/protocol.md "Durability of an accepted prompt").
        """
        stale = await self.store.list_runs({RunStatus.RUNNING, RunStatus.QUEUED})
        finished = now()
        for run in stale:
            run.status = RunStatus.FAILED
            run.error = STOPPED_RUN_ERROR
            run.finished_at = finished
        if self.event_log is not None:
            await self._complete_recovered(stale)
        elif stale:
            await self.store.save_runs(stale)
        unfinished = await self.store.unfinished_assistant_messages()
        for msg in unfinished:
            repair_tool_calls(msg)
            msg.parts.append(FinishPart(FinishReason.ERROR, message=STOPPED_RUN_ERROR))
            msg.updated_at = finished
        if unfinished:
            await self.store.write_messages(unfinished)
        # A tool call whose tool was running at the kill has no result: the session's history
        # would be refused by the providers, so it gets an error result.
        results: list[Message] = []
        for session_id in {r.session_id for r in stale} | {m.session_id for m in unfinished}:
            if self.store.session_exists(session_id):
                results += _missing_tool_results(await self.store.list_messages(session_id))
        if results:
            await self.store.write_messages(results)
        if stale or unfinished:
            log.warning(
                "marked %d runs, %d assistant messages and %d tool calls left by a stopped "
                "server as failed",
                len(stale),
                len(unfinished),
                sum(len(m.parts) for m in results),
            )

    async def _complete_recovered(self, stale: list[Run]) -> None:
        """In a cluster, clients of a node that stopped resume their streams from the log, so
        every run it left must end there with exactly one ``run_complete``:

        1. terminal events recorded but not known to be in the log (the node stopped between
           the record and the append): appended unless the log's tail already holds them;
        2. runs that ended without a record (the node stopped between saving the status and
           recording the event): recorded from the run's record, appended;
        3. runs it left ``queued`` or ``running``: failed, each with its terminal record and
           status in one transaction (False: another node did it first), then appended.
        """
        store: Any = self.store  # the cluster's store
        unlogged = await store.unlogged_terminals()
        if unlogged:
            present = await self._completes_in_log({run_id for run_id, _ in unlogged})
            for run_id, data in unlogged:
                if run_id not in present:
                    complete = wire.converter.structure(orjson.loads(data), RunComplete)
                    await self._append_terminal(complete)
            await store.mark_logged([run_id for run_id, _ in unlogged])
        ended = []
        for run_id in await store.ended_without_record():
            run = await store.get_run(run_id)
            if run is None:
                continue
            complete = RunComplete(
                run.session_id,
                run.run_id,
                run.message_id,
                run.text,
                run.error,
                cancelled=run.status is RunStatus.CANCELLED,
            )
            if await store.record_terminal(run, wire.dumps(complete)):
                await self._append_terminal(complete)
                ended.append(run.run_id)
        for run in stale:
            complete = RunComplete(run.session_id, run.run_id, None, "", STOPPED_RUN_ERROR)
            if await store.record_terminal(run, wire.dumps(complete)):
                await self._append_terminal(complete)
                ended.append(run.run_id)
        await store.mark_logged(ended)

    async def _append_terminal(self, complete: RunComplete) -> None:
        """Publish a recovered ``run_complete``; raises when the log did not take it (this node
        lost the workspace meanwhile: the terminal stays unlogged for the next owner)."""
        event = await self.broker.publish_must_deliver(complete, EventKind.CREATED)
        lost = self.broker.log_lost
        if lost is not None or event.seq > self.broker.durable_seq:
            raise lost or Conflict(f"the event log did not take the end of run {complete.run_id}")

    async def _completes_in_log(self, run_ids: set[str]) -> set[str]:
        """Which of ``run_ids`` have a ``run_complete`` among the log's last
        :data:`RECOVERY_SCAN_EVENTS` events."""
        log_ = self.event_log
        last = await log_.last_seq()
        found: set[str] = set()
        after = max(0, last - RECOVERY_SCAN_EVENTS)
        while after < last:
            batch = await log_.read(after, 1000)
            if not batch:
                break
            for seq, data in batch:
                after = seq
                if b'"run_complete"' not in data:
                    continue
                envelope = orjson.loads(data)
                if envelope.get("type") != "run_complete":
                    continue
                run_id = ((envelope.get("payload") or {}).get("payload") or {}).get("run_id")
                if run_id in run_ids:
                    found.add(run_id)
        return found
