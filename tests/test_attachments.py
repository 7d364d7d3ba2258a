"""Prompt attachments over the wire: accepted, bounded, stored with the user message as
``binary`` parts, over HTTP and the websocket ``agent.prompt`` command.

How each provider API receives them is in tests/test_providers.py.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

import orjson
import pytest
import trio

from crush_trio.attachments import attachment_from_file, check_attachments
from crush_trio.errors import BadRequest, TooLarge
from crush_trio.wire import Attachment, BinaryPart

from .conftest import Server, running_server

if TYPE_CHECKING:
    from pathlib import Path

PNG_BYTES = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR fake image bytes"
PNG = base64.b64encode(PNG_BYTES).decode()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def image(name: str = "shot.png", content: str = PNG) -> dict[str, Any]:
    return {"file_name": name, "mime_type": "image/png", "content": content}


async def post_prompt(server: Server, wid: str, body: dict[str, Any]) -> Any:
    return await server.http.post(f"/v1/workspaces/{wid}/agent", json=body)


async def small_limits_server(tmp_path: Path, **limits: int) -> Any:
    config = tmp_path / "crush.json"
    config.write_text(orjson.dumps({"server": limits}).decode())
    return running_server(tmp_path, config_file=config)


# -- the check itself ---------------------------------------------------------------------------


def test_check_decodes_guesses_types_and_refuses_what_the_model_cannot_read() -> None:
    parts = check_attachments(
        [
            Attachment(file_name="a.png", content=PNG),
            Attachment(file_name="notes", content=b64(b"plain words")),
            Attachment(file_name="x.json", mime_type="application/json", content=b64(b"{}")),
        ]
    )
    assert [(p.path, p.mime_type) for p in parts] == [
        ("a.png", "image/png"),
        ("notes", "text/plain"),
        ("x.json", "application/json"),
    ]
    assert parts[0].content() == PNG_BYTES
    with pytest.raises(BadRequest, match=r"attachments\[0\]\.content is not valid base64"):
        check_attachments([Attachment(file_name="a.png", content="%%%")])
    with pytest.raises(BadRequest, match="neither an image"):
        check_attachments([Attachment(file_name="a.bin", content=b64(b"\xff\xfe\x00\x81"))])
    with pytest.raises(BadRequest, match="no file_name"):
        check_attachments([Attachment(content=PNG)])
    with pytest.raises(BadRequest, match=r"server\.max_attachments\b"):
        check_attachments([Attachment(file_name="a.png", content=PNG)] * 3, max_count=2)


def test_check_bounds_each_and_the_sum_naming_the_key() -> None:
    ten = Attachment(file_name="t.txt", content=b64(b"x" * 10))
    check_attachments([ten], max_each=10)
    with pytest.raises(TooLarge, match=r"11 bytes, the limit \(server\.max_attachment_bytes\) is"):
        check_attachments([Attachment(file_name="t.txt", content=b64(b"x" * 11))], max_each=10)
    with pytest.raises(TooLarge, match=r"server\.max_attachments_bytes\) is 25 bytes"):
        check_attachments([ten, ten, ten], max_each=10, max_total=25)
    # A huge one is refused from its base64 length, before it is decoded.
    with pytest.raises(TooLarge, match=r"server\.max_attachment_bytes"):
        check_attachments([Attachment(file_name="t.txt", content="A" * 4000)], max_each=100)


def test_attachment_from_file_reads_and_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "pic.png"
    path.write_bytes(PNG_BYTES)
    got = attachment_from_file(path)
    assert (got.file_name, got.mime_type, got.file_path) == ("pic.png", "image/png", str(path))
    assert base64.b64decode(got.content) == PNG_BYTES


# -- over HTTP and the websocket ---------------------------------------------------------------


async def test_prompt_with_attachments_is_stored_with_the_user_message(server: Server) -> None:
    ws = await server.open_workspace()
    wid = ws["id"]
    sid = (await server.create_session(wid))["id"]
    with trio.fail_after(10):
        async with server.websocket(wid) as sock:
            r = await post_prompt(
                server,
                wid,
                {
                    "session_id": sid,
                    "prompt": "look",
                    "run_id": "att1",
                    "attachments": [
                        image(),
                        {"file_name": "notes.txt", "content": b64(b"some notes")},
                    ],
                },
            )
            assert r.status_code == 202, r.text
            complete, _ = await sock.run_complete("att1")
    assert complete["error"] is None
    user = (await server.messages(wid, sid))[0]
    assert user["role"] == "user"
    assert user["parts"] == [
        {"type": "text", "data": {"text": "look"}},
        {"type": "binary", "data": {"path": "shot.png", "mime_type": "image/png", "data": PNG}},
        {
            "type": "binary",
            "data": {"path": "notes.txt", "mime_type": "text/plain", "data": b64(b"some notes")},
        },
    ]


async def test_attachment_alone_is_a_prompt_and_bad_ones_are_400(server: Server) -> None:
    ws = await server.open_workspace()
    wid = ws["id"]
    sid = (await server.create_session(wid))["id"]
    r = await post_prompt(server, wid, {"session_id": sid, "prompt": "", "attachments": [image()]})
    assert r.status_code == 202, r.text
    r = await post_prompt(
        server, wid, {"session_id": sid, "prompt": "x", "attachments": [image(content="@@")]}
    )
    assert r.status_code == 400
    assert "base64" in r.json()["message"]
    r = await post_prompt(
        server, wid, {"session_id": sid, "prompt": "x", "attachments": [{"content": 5}]}
    )
    assert r.status_code == 400
    assert "$.attachments[0].content" in r.json()["message"]


async def test_oversized_attachment_is_413_naming_the_limit(tmp_path: Path) -> None:
    async with await small_limits_server(
        tmp_path, max_attachment_bytes=1000, max_attachments_bytes=1500
    ) as server:
        ws = await server.open_workspace()
        wid = ws["id"]
        sid = (await server.create_session(wid))["id"]
        big = {"file_name": "big.txt", "content": b64(b"y" * 1001)}
        r = await post_prompt(server, wid, {"session_id": sid, "prompt": "x", "attachments": [big]})
        assert r.status_code == 413
        message = r.json()["message"]
        assert "server.max_attachment_bytes" in message
        assert "1000 bytes" in message
        half = {"file_name": "half.txt", "content": b64(b"y" * 800)}
        r = await post_prompt(
            server, wid, {"session_id": sid, "prompt": "x", "attachments": [half, half]}
        )
        assert r.status_code == 413
        assert "server.max_attachments_bytes" in r.json()["message"]
        # Nothing was accepted, and the session still takes prompts.
        assert (await server.messages(wid, sid)) == []
        with trio.fail_after(10):
            async with server.websocket(wid) as sock:
                await server.prompt(wid, sid, "still here", run_id="after")
                complete, _ = await sock.run_complete("after")
        assert complete["text"] == "still here"


async def test_websocket_prompt_takes_attachments_and_bounds_them(tmp_path: Path) -> None:
    async with await small_limits_server(tmp_path, max_attachment_bytes=1000) as server:
        ws = await server.open_workspace()
        wid = ws["id"]
        with trio.fail_after(10):
            async with server.websocket(wid) as sock:
                await sock.recv()
                sid = (await sock.command("sessions.create", title="t"))["result"]["id"]
                reply = await sock.command(
                    "agent.prompt",
                    session_id=sid,
                    prompt="over the socket",
                    run_id="wsa",
                    attachments=[image()],
                )
                assert reply["ok"], reply
                await sock.run_complete("wsa")
                reply = await sock.command(
                    "agent.prompt",
                    session_id=sid,
                    prompt="too big",
                    attachments=[{"file_name": "b.txt", "content": b64(b"z" * 2000)}],
                )
                assert reply["ok"] is False
                assert reply["status"] == 413
                assert "server.max_attachment_bytes" in reply["message"]
                reply = await sock.command("messages.list", session_id=sid)
        user = reply["result"][0]
        assert user["parts"][1] == {
            "type": "binary",
            "data": {"path": "shot.png", "mime_type": "image/png", "data": PNG},
        }


def test_binary_part_round_trips_through_the_store_format() -> None:
    from crush_trio import wire

    parts = [wire.TextPart("t"), BinaryPart(path="a.png", mime_type="image/png", data=PNG)]
    assert wire.parts_from_json(wire.parts_to_json(parts)) == parts
