"""The broker's direct write: a frame for an idle client goes to its socket at once, in the
publisher's task (:attr:`crush_trio.broker.ClientStream.send_now`), and what the socket does not
take at once is sent whole by the writer before anything else.

Checked on a real server, with raw clients that decode every frame, compressed and not: the
frames are the same, in the same order, whether they went out directly, in part, or through the
writer.
"""

from __future__ import annotations

import os
import socket
import struct
from collections import Counter
from typing import TYPE_CHECKING, Any

import orjson
import trio
from wsproto.extensions import PerMessageDeflate

from crush_trio.broker import SENT, SENT_IN_PART, Event
from crush_trio.server import listener
from crush_trio.server.ws_trio import TrioEventSocket
from crush_trio.wire import AgentEvent

from .test_ws_deflate import CAP, REPLY, comparable, open_raw, reply_step

if TYPE_CHECKING:
    from collections.abc import Sequence

    import pytest

    from crush_trio.client import WorkspaceClient
    from crush_trio.providers.scripted import ScriptedModel
    from crush_trio.testing import CrushServer


class CountedSends:
    """Counts what :meth:`TrioEventSocket.send_now` answered, by answer."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.answers: Counter[int] = Counter()
        #: Direct writes by the number of frames each wrote.
        self.frames: Counter[int] = Counter()
        send_now = TrioEventSocket.send_now

        def counted(sock: TrioEventSocket, events: Sequence[Event]) -> int:
            answer = send_now(sock, events)
            self.answers[answer] += 1
            self.frames[len(events)] += 1
            return answer

        monkeypatch.setattr(TrioEventSocket, "send_now", counted)


class HalfWrites:
    """``os`` for the listener, whose ``write`` takes at most half of what it is given (at least
    one byte): as a socket with little room left would."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def write(fd: int, data: bytes) -> int:
        return os.write(fd, data[: max(1, len(data) // 2)])


async def watch_one_run(
    server: CrushServer, ws: WorkspaceClient, model: ScriptedModel
) -> dict[str, list[tuple[int, str, bytes]]]:
    """One paced reply watched by a plain and a compressed raw client: their decoded frames."""
    session = await ws.create_session()
    model.add(reply_step())
    with trio.fail_after(CAP):
        plain = await open_raw(server, ws.id, [])
        packed = await open_raw(server, ws.id, [PerMessageDeflate()])
        for raw in (plain, packed):
            await raw.messages_until(None)  # the hello
        handle = await ws.prompt(session.id, "stream a reply")
        got = {
            "plain": comparable(await plain.messages_until(handle.run_id)),
            "packed": comparable(await packed.messages_until(handle.run_id)),
        }
        await handle.wait(CAP)
        for raw in (plain, packed):
            await raw.stream.aclose()
    _, kind, payload = got["plain"][-1]
    assert kind == "run_complete"
    complete = orjson.loads(payload)["payload"]
    assert complete["text"] == REPLY
    assert complete.get("error") is None
    return got


async def test_frames_for_idle_clients_go_out_directly_and_decode_the_same(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sends = CountedSends(monkeypatch)
    got = await watch_one_run(crush_server, crush_workspace, scripted_model)
    assert got["packed"] == got["plain"]
    assert sum(kind == "message_delta" for _, kind, _ in got["plain"]) >= 3
    # A paced reply finds both writers idle between tokens: its frames go out directly.
    assert sends.answers[SENT] >= 6
    assert sends.answers[SENT_IN_PART] == 0


async def test_frames_the_socket_takes_only_in_part_are_finished_by_the_writer_in_order(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sends = CountedSends(monkeypatch)
    monkeypatch.setattr(listener, "os", HalfWrites())
    got = await watch_one_run(crush_server, crush_workspace, scripted_model)
    assert got["packed"] == got["plain"]
    assert sum(kind == "message_delta" for _, kind, _ in got["plain"]) >= 3
    # Every direct write took half a frame; the writer sent each rest before the next frame.
    assert sends.answers[SENT_IN_PART] >= 6
    assert sends.answers[SENT] == 0


async def watch_replies_in_step(
    server: CrushServer, ws: WorkspaceClient, model: ScriptedModel, replies: int = 3
) -> dict[str, list[tuple[int, str, bytes]]]:
    """``replies`` paced replies at once, watched by a plain and a compressed raw client: their
    decoded frames (the same in both, every seq once and in order, checked here)."""
    sessions = [await ws.create_session() for _ in range(replies)]
    for _ in sessions:
        model.add(reply_step())
    with trio.fail_after(CAP):
        plain = await open_raw(server, ws.id, [])
        packed = await open_raw(server, ws.id, [PerMessageDeflate()])
        for raw in (plain, packed):
            await raw.messages_until(None)  # the hello
        handles = [await ws.prompt(session.id, "stream a reply") for session in sessions]
        got = {}
        for name, raw in (("plain", plain), ("packed", packed)):
            frames: list[dict[str, Any]] = []
            for handle in handles:
                ended = {
                    f["payload"]["payload"]["run_id"] for f in frames if f["type"] == "run_complete"
                }
                if handle.run_id not in ended:
                    frames += await raw.messages_until(handle.run_id)
            got[name] = comparable(frames)
        for handle in handles:
            await handle.wait(CAP)
        for raw in (plain, packed):
            await raw.stream.aclose()
    assert got["packed"] == got["plain"]
    seqs = [seq for seq, _, _ in got["plain"]]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert [kind for _, kind, _ in got["plain"]].count("run_complete") == replies
    return got


async def test_replies_in_step_go_out_several_frames_per_write_the_same_to_every_client(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three replies streaming at once: their publish windows fall into step, and a window's
    frames reach a client in two writes (its first frame at once, the rest at the batch's end).
    A plain and a compressed client decode the same frames, every seq once and in order."""
    sends = CountedSends(monkeypatch)
    await watch_replies_in_step(crush_server, crush_workspace, scripted_model)
    assert sum(n for size, n in sends.frames.items() if size > 1) >= 2


async def test_replies_in_step_to_sockets_with_little_room_are_finished_in_order(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same with every write taken only in half: each batch's first frame is left in part,
    the writer finishes it and sends the rest of the window's frames after it, whole."""
    sends = CountedSends(monkeypatch)
    monkeypatch.setattr(listener, "os", HalfWrites())
    await watch_replies_in_step(crush_server, crush_workspace, scripted_model)
    assert sends.answers[SENT_IN_PART] >= 6
    assert sends.answers[SENT] == 0


async def test_a_client_reset_within_a_batch_ends_its_connection_only(
    crush_server: CrushServer, crush_workspace: WorkspaceClient
) -> None:
    """A client whose connection is reset after a batch's first frame went out: the write of
    the held frames fails, its rest goes to the writer, which finds the client gone and ends
    that connection. The other client gets every frame of the batch; the server serves on."""
    broker = crush_server.backend.get(crush_workspace.id).broker
    with trio.fail_after(CAP):
        gone = await open_raw(crush_server, crush_workspace.id, [])
        kept = await open_raw(crush_server, crush_workspace.id, [PerMessageDeflate()])
        for raw in (gone, kept):
            await raw.messages_until(None)  # the hello
        before = len(broker.clients)
        with broker.batched():
            first = broker.publish(AgentEvent("info", text="first"))
            # A reset (linger 0) reaches the server's socket at once on loopback.
            gone.stream.socket.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
            gone.stream.socket.close()
            for n in range(3):
                broker.publish(AgentEvent("info", text=f"held {n}"))
        frames = []
        while len(frames) < 4:
            frames += await kept.messages_until(None)
        assert [f["seq"] for f in frames] == list(range(first.seq, first.seq + 4))
        while len(broker.clients) != before - 1:  # the reset client's connection ended
            await trio.testing.wait_all_tasks_blocked(0.01)
        again = await open_raw(crush_server, crush_workspace.id, [])
        await again.messages_until(None)
        for raw in (kept, again):
            await raw.stream.aclose()
