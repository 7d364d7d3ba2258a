"""The client's plain-logic pieces, without an event loop: the stream's sequence rules
(:class:`StreamStats`) and what a run handle asks of its stream (:class:`RunFeed`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import pytest

from crush_trio.client import Event, RunComplete, RunHandle, StreamStats
from crush_trio.wire import PermissionRequest

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
