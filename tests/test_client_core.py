"""The client's plain-logic pieces, without an event loop: the stream's sequence rules
(:class:`StreamStats`) and what a run handle asks of its stream (:class:`RunFeed`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import pytest

from crush_trio.client import Event, RunComplete, RunHandle, StreamStats
from crush_trio.client.events import Gap
from crush_trio.client.runs import route_of
from crush_trio.wire import (
    AgentEvent,
    DeltaPartType,
    Message,
    MessageDelta,
    PermissionNotification,
    PermissionRequest,
    Role,
    Session,
    TextPart,
    ToolCallPart,
)

if TYPE_CHECKING:
    from crush_trio.client.runs import GrantAction

# (calls on a fresh StreamStats, expected (last_seq, connects, reconnects, events))
HELLO_CASES: list[tuple[list[tuple[str, int]], tuple[int, int, int, int]]] = [
    ([("hello", 7)], (7, 1, 0, 0)),
    ([("hello", 7), ("event", 8), ("event", 9)], (9, 1, 0, 2)),
    # A replay that overlaps what arrived before the drop: the old seqs are not passed on.
    ([("hello", 0), ("event", 1), ("event", 2), ("rehello", 2), ("event", 2), ("event", 3)],
     (3, 2, 1, 3)),
    # A reconnect to a server whose sequence restarted follows the server's numbering.
    ([("hello", 50), ("event", 51), ("rehello", 4), ("event", 5)], (5, 2, 1, 2)),
    # A reconnect to a server further ahead resumes from the last event seen (it replays).
    ([("hello", 3), ("rehello", 10), ("event", 4)], (4, 2, 1, 1)),
]  # fmt: skip


@pytest.mark.parametrize(("calls", "expected"), HELLO_CASES)
def test_stream_stats_sequence_rules(
    calls: list[tuple[str, int]], expected: tuple[int, int, int, int]
) -> None:
    stats = StreamStats()
    for what, seq in calls:
        if what == "event":
            stats.on_event(seq)
        else:
            stats.on_hello(seq, first=what == "hello")
    assert (stats.last_seq, stats.connects, stats.reconnects, stats.events) == expected


def test_stream_stats_reports_duplicates() -> None:
    stats = StreamStats()
    stats.on_hello(5, first=True)
    assert stats.on_event(5) is False  # the hello's seq was already seen
    assert stats.on_event(6) is True
    assert stats.on_event(6) is False
    assert stats.events == 1


@attrs.define
class RecordingFeed:
    """A :class:`RunFeed` that records what the handle asked for."""

    calls: list[tuple[str, Any]] = attrs.Factory(list)

    def resync(self, handle: RunHandle, *, messages: bool) -> None:
        self.calls.append(("resync", messages))

    def grant_soon(self, permission_id: str, action: GrantAction) -> None:
        self.calls.append(("grant", (permission_id, action)))

    def forget(self, handle: RunHandle) -> None:
        self.calls.append(("forget", handle.run_id))


def handle_with(feed: RecordingFeed, *, auto_approve: bool = False) -> RunHandle:
    return RunHandle(
        None,  # type: ignore[arg-type]  # the workspace is only used for HTTP, not here
        "s1",
        "r1",
        "hi",
        feed=feed,
        auto_approve=auto_approve,
    )


def test_run_handle_asks_its_feed_to_resync_an_unmatched_permission_request() -> None:
    feed = RecordingFeed()
    handle = handle_with(feed, auto_approve=True)
    request = PermissionRequest("p1", "s1", "call-1", "bash")
    handle.offer(Event("permission_request", request, 3, "created"))
    # Its tool call is not known yet: the messages are re-read, and nothing is granted.
    assert feed.calls == [("resync", True)]
    assert handle.permission_requests == {}


def test_run_handle_forgets_itself_when_its_run_completes_and_ignores_others() -> None:
    feed = RecordingFeed()
    handle = handle_with(feed)
    handle.offer(Event("run_complete", RunComplete("s1", "other"), 4, "created"))
    assert feed.calls == []
    assert not handle.done
    handle.offer(Event("run_complete", RunComplete("s1", "r1", text="done"), 5, "created"))
    assert feed.calls == [("forget", "r1")]
    assert handle.done
    assert handle.text == "done"


def _state(handle: RunHandle, feed: RecordingFeed) -> tuple[Any, ...]:
    return (
        handle.events_received,
        handle.done,
        handle.started,
        dict(handle.messages),
        list(handle.errors),
        dict(handle.permission_requests),
        len(feed.calls),
    )


def _routing_events() -> list[Event]:
    """One workspace's events for two sessions: the turns of ``ra`` (prompt "hi") and ``rb``
    (prompt "hi" in another session), with a tool call, its permission, errors and a gap."""
    user_a = Message("ua", "sa", Role.USER, [TextPart("hi")])
    reply_a = Message("aa", "sa", Role.ASSISTANT, [ToolCallPart("call-1", "bash")])
    grown_a = Message("aa", "sa", Role.ASSISTANT, [ToolCallPart("call-1", "bash"), TextPart("x")])
    delta_a = MessageDelta("aa", "sa", 1, DeltaPartType.TEXT, 0, "x")
    user_b = Message("ub", "sb", Role.USER, [TextPart("hi")])
    return [
        Event("message", user_a, 1, "created"),
        Event("message", reply_a, 2, "created"),
        Event("message_delta", delta_a, 3, "updated", None, grown_a),
        Event("message", user_b, 4, "created"),
        Event("agent_event", AgentEvent("error", run_id="ra", text="boom"), 5, "created"),
        Event("agent_event", AgentEvent("retry", session_id="sb", text="again"), 6, "created"),
        Event("agent_event", AgentEvent("mcp", text="up"), 7, "created"),
        Event("permission_request", PermissionRequest("p1", "sa", "call-1", "bash"), 8, "created"),
        Event("permission_notification", PermissionNotification("call-1", granted=True), 9),
        Event("session", Session("sa", "title"), 10, "updated"),
        Event("gap", Gap(3), None, "created"),
        Event("run_complete", RunComplete("sa", "other", message_id="zz"), 11, "created"),
        Event("run_complete", RunComplete("sa", "ra", text="done"), 12, "created"),
        Event("run_complete", RunComplete("sb", "rb", text="done"), 13, "created"),
    ]


def test_an_event_is_offered_only_to_the_handles_that_can_keep_it() -> None:
    """The event stream offers an event only to the handles of its route (the handles of its
    session, or of its run): a client following many runs pays per event for the runs of that
    session, not for all of them. Every handle outside the route would have kept nothing."""
    feeds = {name: RecordingFeed() for name in ("ra", "ra2", "rb")}
    handles = {
        "ra": RunHandle(None, "sa", "ra", "hi", feed=feeds["ra"]),  # type: ignore[arg-type]
        "ra2": RunHandle(None, "sa", "ra2", "yo", feed=feeds["ra2"]),  # type: ignore[arg-type]
        "rb": RunHandle(None, "sb", "rb", "hi", feed=feeds["rb"]),  # type: ignore[arg-type]
    }
    narrow = 0
    for event in _routing_events():
        route = route_of(event)
        for name, handle in handles.items():
            routed = route is not None and (
                handle.run_id == route.run_id
                if route.run_id is not None
                else route.session_id in (None, handle.session_id)
            )
            before = _state(handle, feeds[name])
            handle.offer(event)
            if not routed:
                assert _state(handle, feeds[name]) == before, (event.type, event.seq, name)
                narrow += 1
    # Every handle kept what was its own: the routes lost nothing.
    assert [handles[n].text for n in ("ra", "rb")] == ["done", "done"]
    assert handles["ra"].errors[0].text == "boom"
    assert list(handles["ra"].permission_requests) == ["p1"]
    assert not handles["ra2"].done
    # Messages, deltas, session-wide agent events and run_complete reach one session only.
    assert route_of(_routing_events()[2]) is not None
    assert route_of(_routing_events()[2]).session_id == "sa"  # type: ignore[union-attr]
    assert narrow >= 20


def test_the_client_drops_an_idle_connection_before_the_server_closes_it() -> None:
    """A pooled connection is reused only while the server still keeps it: a request sent as
    the server closes an idle connection fails ("Server disconnected without sending a
    response"), which happened to a benchmark's session create between two rounds."""
    from crush_trio.client.connection import KEEPALIVE_EXPIRY
    from crush_trio.server.serve import KEEP_ALIVE_TIMEOUT

    assert KEEPALIVE_EXPIRY <= KEEP_ALIVE_TIMEOUT - 1.0
