"""The per-client queue and gap rules (:class:`crush_trio.broker.outbox.Outbox`) as tables.

No event loop: each row is a queue size and a string of moves, played against a bare outbox
with a hand-set clock, and the expected verdicts, queue, drops, gap and stall decisions.

Moves (space separated):

* ``L`` — offer the next lossy event (verdict ``+`` queued, ``x`` dropped into the gap);
* ``B`` — offer the next lossy event, larger than the byte bound;
* ``M`` — offer the next must-deliver event (``+`` queued, ``w`` the shell must wait: the wait is
  reserved, as the shell does);
* ``R`` — the wait ends: the waiting must-deliver event is queued, then the gap if there is room;
* ``D`` / ``S`` — offer a delta change whose snapshot form was (``D``) / was not (``S``) encoded;
* ``T`` — the writer takes one item (and the pending gap goes out if there is room);
* ``t`` — the writer takes one item, in the middle of a batch (the gap stays pending);
* ``C`` — the stream closes;
* ``I`` / ``i`` — the shell can (``I``) / cannot (``i``) send an item for the empty queue at once
  (a direct write while the writer is idle); what it sends joins the frames the client got;
* ``+N`` — N seconds pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

import orjson
import pytest

from crush_trio.broker import Event, Gap
from crush_trio.broker.outbox import Outbox

#: Bytes of every event of the tables (``B`` excepted).
EVENT_BYTES = 40


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Recording(Outbox):
    """An outbox that records the hooks the shell would act on."""

    __slots__ = ("direct", "hooks", "sent")

    def __init__(self, size: int, max_bytes: int, *, deltas: bool, clock: Clock) -> None:
        super().__init__(size, max_bytes, deltas=deltas, clock=clock)
        self.hooks: list[str] = []
        #: The shell sends an item for the empty queue at once (``I``/``i``) ...
        self.direct = False
        #: ... into this list: what the client got, in order (the writer's takes too).
        self.sent: list[str] = []

    def _send_now(self, item: Event) -> bool:
        if not self.direct:
            return False
        self.hooks.append("sent")
        self.sent.append(label(item))
        return True

    def _wake_writer(self) -> None:
        self.hooks.append("wake")

    def _stalled(self) -> None:
        self.hooks.append("stalled")

    def _dropped_one(self) -> None:
        self.hooks.append("drop")

    def _gap_sent(self) -> None:
        self.hooks.append("gap")

    def _room_made(self) -> None:
        self.hooks.append("room")


class Player:
    """Plays a string of moves against one outbox."""

    def __init__(self, size: int, max_bytes: int = 10_000, *, deltas: bool = False) -> None:
        self.clock = Clock()
        self.box = Recording(size, max_bytes, deltas=deltas, clock=self.clock)
        self.seq = 0
        #: Must-deliver events waiting for room, oldest first.
        self.waiting: list[Event] = []
        self.verdicts = ""

    def event(self, *, size: int = EVENT_BYTES, must_deliver: bool = False) -> Event:
        self.seq += 1
        kind = "run_complete" if must_deliver else "agent_event"
        return Event(self.seq, kind, "x" * size, must_deliver)

    def delta(self, *, encoded: bool) -> Event:
        self.seq += 1
        event = Event(self.seq, "message_delta", "d" * EVENT_BYTES, False)
        event.is_delta = True
        if encoded:
            event.snapshot = Event(self.seq, "message", "s" * EVENT_BYTES, False)
        return event

    def play(self, moves: str) -> Player:
        box = self.box
        for move in moves.split():
            if move.startswith("+"):
                self.clock.now += float(move[1:])
            elif move in ("L", "B", "D", "S"):
                if move == "L":
                    event = self.event()
                elif move == "B":
                    event = self.event(size=box.max_bytes + 1)
                else:
                    event = self.delta(encoded=move == "D")
                self.verdicts += "+" if box.offer(event) else "x"
            elif move == "M":
                event = self.event(must_deliver=True)
                if box.try_deliver_nowait(event):
                    self.verdicts += "+"
                else:
                    box.reserve_delivery()
                    self.waiting.append(event)
                    self.verdicts += "w"
            elif move == "R":
                event = self.waiting.pop(0)
                assert box.fits(event.size), "the wait ended without room"
                assert box.put_nowait(event)
                box.release_delivery()
                box.after_receive()
            elif move in ("T", "t"):
                item = box.take()
                assert item is not None, "nothing to take"
                box.sent.append(label(item))
                if move == "T":
                    box.after_receive()
            elif move == "C":
                box.close()
            elif move in ("I", "i"):
                box.direct = move == "I"
            else:  # pragma: no cover - a typo in a table
                raise ValueError(move)
        return self

    @property
    def queue(self) -> list[str]:
        return [label(item) for item in self.box.items]

    @property
    def taken(self) -> list[str]:
        """What the client got so far, in order: taken by its writer or sent at once."""
        return self.box.sent

    @property
    def frames(self) -> list[str]:
        """Everything the client got, in order: what it took, then what is still queued."""
        return self.taken + self.queue


def label(item: Event) -> str:
    """``3`` for event 3, ``m3`` for a must-deliver one, ``s3`` for a snapshot form, ``d3`` for
    a delta form, ``gap3-5`` for a gap frame."""
    if item.type == "gap":
        payload = orjson.loads(item.text)["payload"]
        assert payload["dropped"] == payload["to_seq"] - payload["from_seq"] + 1
        return f"gap{payload['from_seq']}-{payload['to_seq']}"
    prefix = {"run_complete": "m", "message": "s", "message_delta": "d"}.get(item.type, "")
    return f"{prefix}{item.seq}"


def gap_of(box: Outbox) -> tuple[int, int, int] | None:
    gap = box.gap
    return None if gap is None else (gap.dropped, gap.from_seq, gap.to_seq)


# -- lossy events, drops and gaps ---------------------------------------------------------------

LOSSY = [
    # size, moves, verdicts, frames (taken, then queued), dropped, pending gap
    pytest.param(3, "L L L", "+++", ["1", "2", "3"], 0, None, id="room-for-all"),
    pytest.param(2, "L L L L", "++xx", ["1", "2"], 2, (2, 3, 4), id="full-drops-into-one-gap"),
    pytest.param(
        2, "L L L T", "++x", ["1", "2", "gap3-3"], 1, None, id="gap-goes-out-once-writer-takes"
    ),
    pytest.param(
        3,
        "L L L L L T L T T L",
        "+++xx" + "x" + "+",
        ["1", "2", "3", "gap4-5", "gap6-6", "7"],
        3,
        None,
        id="each-run-of-drops-is-one-gap-in-order",
    ),
    pytest.param(
        3,
        "L L L L t L",
        "+++xx",
        ["1", "2", "3"],
        2,
        (2, 4, 5),
        id="no-gap-frame-without-room-for-the-event-behind-it",
    ),
    pytest.param(1, "B", "+", ["1"], 0, None, id="empty-queue-takes-one-oversized-item"),
    pytest.param(1, "L B", "+x", ["1"], 1, (1, 2, 2), id="oversized-item-waits-for-empty-queue"),
    pytest.param(2, "L L L C L", "++xx", ["1", "2"], 1, (1, 3, 3), id="closed-takes-nothing-more"),
    pytest.param(3, "L L C T T", "++", ["1", "2"], 0, None, id="closed-still-drains"),
]


@pytest.mark.parametrize(("size", "moves", "verdicts", "frames", "dropped", "gap"), LOSSY)
def test_lossy_events_are_queued_or_dropped_into_a_gap(
    size: int,
    moves: str,
    verdicts: str,
    frames: list[str],
    dropped: int,
    gap: tuple[int, int, int] | None,
) -> None:
    played = Player(size).play(moves)
    assert played.verdicts == verdicts
    assert played.frames == frames
    assert played.box.dropped == dropped
    assert gap_of(played.box) == gap
    assert played.box.gaps == sum(1 for f in frames if f.startswith("gap"))


BYTES = [
    # max_bytes, moves, verdicts, frames, pending gap
    pytest.param(100, "L L", "++", ["1", "2"], None, id="two-fit-in-the-byte-bound"),
    pytest.param(100, "L L L", "++x", ["1", "2"], (1, 3, 3), id="third-exceeds-the-byte-bound"),
    pytest.param(
        100,
        "L L L T",
        "++x",
        ["1", "2"],
        (1, 3, 3),
        id="gap-frame-waits-when-it-does-not-fit-the-bytes",
    ),
    pytest.param(
        100,
        "L L L T L",
        "++xx",
        ["1", "2"],
        (2, 3, 4),
        id="event-behind-a-gap-needs-room-for-both",
    ),
    pytest.param(
        100, "L L L T L T", "++xx", ["1", "2", "gap3-4"], None, id="empty-queue-takes-the-gap"
    ),
]


@pytest.mark.parametrize(("max_bytes", "moves", "verdicts", "frames", "gap"), BYTES)
def test_the_byte_bound_applies_to_events_and_gap_frames(
    max_bytes: int, moves: str, verdicts: str, frames: list[str], gap: tuple[int, int, int] | None
) -> None:
    played = Player(10, max_bytes).play(moves)
    assert played.verdicts == verdicts
    assert played.frames == frames
    assert gap_of(played.box) == gap
    assert played.box.bytes == sum(item.size for item in played.box.items)
    assert played.box.bytes <= max_bytes


DELTAS = [
    # client gets deltas, moves, verdicts, frames, dropped
    pytest.param(True, "D S", "++", ["d1", "d2"], 0, id="delta-client-gets-every-delta"),
    pytest.param(False, "D", "+", ["s1"], 0, id="snapshot-client-gets-the-snapshot-form"),
    pytest.param(False, "D S D", "+x+", ["s1", "gap2-2", "s3"], 1, id="missing-form-is-a-gap"),
]


@pytest.mark.parametrize(("deltas", "moves", "verdicts", "frames", "dropped"), DELTAS)
def test_a_delta_change_is_offered_in_the_clients_form(
    deltas: bool, moves: str, verdicts: str, frames: list[str], dropped: int
) -> None:
    played = Player(10, deltas=deltas).play(moves)
    assert played.verdicts == verdicts
    assert played.frames == frames
    assert played.box.dropped == dropped


# -- must-deliver events ------------------------------------------------------------------------

MUST_DELIVER = [
    # size, moves, verdicts, frames, must-deliver waits
    pytest.param(2, "L M", "++", ["1", "m2"], 0, id="room-queues-at-once"),
    pytest.param(2, "L L M", "++w", ["1", "2"], 1, id="no-room-must-wait"),
    pytest.param(
        2,
        "L L M L T R T T",
        "++wx",
        ["1", "2", "m3", "gap4-4"],
        1,
        id="lossy-events-held-back-behind-a-wait-stay-in-order",
    ),
    pytest.param(
        3,
        "L L L L t t M",
        "+++x+",
        ["1", "2", "3", "gap4-4", "m5"],
        0,
        id="must-deliver-goes-out-behind-the-pending-gap",
    ),
    pytest.param(2, "L L L t M", "++xw", ["1", "2", "gap3-3"], 1, id="gap-first-then-no-room"),
    pytest.param(
        2,
        "L L M T L R T T",
        "++wx",
        ["1", "2", "m3", "gap4-4"],
        1,
        id="room-during-a-wait-is-kept-for-the-waiting-event",
    ),
    pytest.param(
        2,
        "L L M T M R T R T T",
        "++ww",
        ["1", "2", "m3", "m4"],
        2,
        id="a-second-must-deliver-waits-behind-the-first",
    ),
    pytest.param(2, "L L C M", "+++", ["1", "2"], 0, id="closed-stream-needs-nothing-more"),
]


@pytest.mark.parametrize(("size", "moves", "verdicts", "frames", "waits"), MUST_DELIVER)
def test_must_deliver_events_are_queued_or_waited_for(
    size: int, moves: str, verdicts: str, frames: list[str], waits: int
) -> None:
    played = Player(size).play(moves)
    assert played.verdicts == verdicts
    assert played.frames == frames
    assert played.box.must_deliver_waits == waits
    assert played.box.holding == len(played.waiting)


# -- the stall clock: disconnect as too slow ----------------------------------------------------

STALLS = [
    # size, moves, bound, overdue now, when the clock started
    pytest.param(2, "L", 2.0, False, None, id="room-left-no-clock"),
    pytest.param(2, "L L +1.9", 2.0, False, 0.0, id="full-but-within-the-bound"),
    pytest.param(2, "L L +2", 2.0, True, 0.0, id="full-for-the-bound-is-too-slow"),
    pytest.param(2, "L L L +2", 2.0, True, 0.0, id="drops-do-not-restart-the-clock"),
    pytest.param(2, "L L +1 T +1.5", 2.0, False, None, id="taking-that-leaves-room-stops-it"),
    pytest.param(2, "L L L +1 T +1.5", 2.0, False, 1.0, id="the-gap-refilling-it-restarts-it"),
    pytest.param(2, "L L L +1 T +2", 2.0, True, 1.0, id="restarted-clock-runs-out-too"),
    pytest.param(1, "B +5", 2.0, True, 0.0, id="one-oversized-item-fills-the-queue"),
    pytest.param(2, "L L +5 C", 2.0, False, None, id="closed-is-never-too-slow"),
]


@pytest.mark.parametrize(("size", "moves", "bound", "overdue", "since"), STALLS)
def test_a_queue_that_stays_full_without_progress_is_too_slow(
    size: int, moves: str, bound: float, overdue: bool, since: float | None
) -> None:
    played = Player(size, 100).play(moves)
    box = played.box
    assert box.full_since == since
    assert box.overdue(played.clock.now, bound) is overdue
    deadline = box.stall_deadline(bound)
    assert (deadline is None) is (since is None or box.closed)
    if deadline is not None:
        assert deadline == since + bound


# -- what the shell is told ---------------------------------------------------------------------

HOOKS = [
    # size, moves, hooks the shell acts on
    pytest.param(3, "L L", ["wake"], id="writer-woken-once-per-empty-queue"),
    pytest.param(3, "L T L", ["wake", "wake"], id="again-after-it-emptied"),
    pytest.param(2, "L L L", ["wake", "stalled", "drop"], id="stall-once-then-drops"),
    pytest.param(
        2,
        "L L L T",
        ["wake", "stalled", "drop", "stalled", "gap"],
        id="gap-refills-the-queue-and-restarts-the-stall",
    ),
    pytest.param(2, "L L M T", ["wake", "stalled", "room"], id="a-wait-is-told-of-room"),
]


@pytest.mark.parametrize(("size", "moves", "hooks"), HOOKS)
def test_the_shell_is_told_only_on_transitions(size: int, moves: str, hooks: list[str]) -> None:
    assert Player(size).play(moves).box.hooks == hooks


DIRECT = [
    # size, moves, verdicts, frames (got, then queued), shell hooks
    pytest.param(
        2, "I L L L", "+++", ["1", "2", "3"], ["sent"] * 3, id="sent-at-once-never-queued"
    ),
    pytest.param(
        3,
        "L I L T L T T L",
        "++++",
        ["1", "2", "3", "4"],
        ["wake", "sent"],
        id="only-into-the-empty-queue-so-order-is-kept",
    ),
    pytest.param(
        2,
        "L L L L T T I L",
        "++xx+",
        ["1", "2", "gap3-4", "5"],
        ["wake", "stalled", "drop", "drop", "stalled", "gap", "stalled"],
        id="queued-behind-a-gap-never-sent-past-it",
    ),
    pytest.param(
        1,
        "L L I T L",
        "+x+",
        ["1", "gap2-2", "3"],
        ["wake", "stalled", "drop", "sent", "gap", "sent"],
        id="a-gap-for-the-drained-queue-is-sent-then-the-next",
    ),
    pytest.param(1, "I M", "+", ["m1"], ["sent"], id="must-deliver-too"),
    pytest.param(1, "I C L", "x", [], [], id="closed-sends-nothing"),
]


@pytest.mark.parametrize(("size", "moves", "verdicts", "frames", "hooks"), DIRECT)
def test_an_item_for_the_empty_queue_may_be_sent_at_once(
    size: int, moves: str, verdicts: str, frames: list[str], hooks: list[str]
) -> None:
    played = Player(size).play(moves)
    assert played.verdicts == verdicts
    assert played.frames == frames
    assert played.box.hooks == hooks
    assert played.box.bytes == sum(item.size for item in played.box.items)


def test_counts_and_peaks() -> None:
    played = Player(3, 1000).play("L L L L L T T T L")
    box = played.box
    assert (box.dropped, box.gaps, box.peak_depth) == (2, 1, 3)
    assert box.peak_bytes == 2 * EVENT_BYTES + Gap(2, 4, 5).frame(5).size  # 2, 3 and the gap
    assert played.frames == ["1", "2", "3", "gap4-5", "6"]


def test_clear_empties_the_queue_and_its_bytes() -> None:
    box = Player(5).play("L L L").box
    box.clear()
    assert box.take() is None
    assert box.bytes == 0
    assert len(box.items) == 0


def test_a_gap_frame_carries_the_latest_seq_the_shell_stamps() -> None:
    frame = Gap(2, 3, 4).frame(9)
    assert orjson.loads(frame.text) == {
        "seq": 9,
        "type": "gap",
        "payload": {"dropped": 2, "from_seq": 3, "to_seq": 4},
    }


@pytest.mark.parametrize("module", ["outbox.py", "framing.py"])
def test_the_core_and_the_framing_import_no_event_loop_and_no_io(module: str) -> None:
    path = Path(__file__).resolve().parent.parent / "crush_trio" / "broker" / module
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"trio", "anyio", "asyncio", "socket", "httpx", "sqlite3", "logging"}
