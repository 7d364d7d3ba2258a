"""The broker's direct write: a frame for an idle client goes to its socket at once, in the
publisher's task (:attr:`crush_trio.broker.ClientStream.send_now`), and what the socket does not
take at once is sent whole by the writer before anything else.

Checked on a real server, with raw clients that decode every frame, compressed and not: the
frames are the same, in the same order, whether they went out directly, in part, or through the
writer.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import TYPE_CHECKING, Any

import orjson
import trio
from wsproto.extensions import PerMessageDeflate

from crush_trio.broker import SENT, SENT_IN_PART, Event
from crush_trio.server import listener
from crush_trio.server.ws_trio import TrioEventSocket

from .test_ws_deflate import CAP, REPLY, comparable, open_raw, reply_step

if TYPE_CHECKING:
    import pytest

    from crush_trio.client import WorkspaceClient
    from crush_trio.providers.scripted import ScriptedModel
    from crush_trio.testing import CrushServer


class CountedSends:
    """Counts what :meth:`TrioEventSocket.send_now` answered, by answer."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.answers: Counter[int] = Counter()
        send_now = TrioEventSocket.send_now

        def counted(sock: TrioEventSocket, event: Event) -> int:
            answer = send_now(sock, event)
            self.answers[answer] += 1
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
