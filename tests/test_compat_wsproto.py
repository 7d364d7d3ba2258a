"""The wsproto adapter (crush_trio/_compat/wsproto.py): a server connection lets go of its opening
handshake once open, keeps working both ways, and an upgrade that breaks the assumption fails
loudly at import instead of losing events."""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING, Any

import pytest
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Event, Request, TextMessage

from crush_trio._compat import CompatError
from crush_trio._compat import wsproto as wsproto_compat

if TYPE_CHECKING:
    from collections.abc import Iterator


def open_pair() -> tuple[WSConnection, WSConnection]:
    """A client and a server connection, upgraded against each other (no I/O)."""
    client = WSConnection(ConnectionType.CLIENT)
    server = WSConnection(ConnectionType.SERVER)
    server.receive_data(client.send(Request(host="example.com", target="/v1/x/ws")))
    assert [type(e) for e in server.events()] == [Request]
    client.receive_data(server.send(AcceptConnection()))
    assert [type(e) for e in client.events()] == [AcceptConnection]
    return client, server


def test_the_adapter_names_the_installed_wsproto() -> None:
    for name, version in wsproto_compat.CHECKED_AGAINST.items():
        assert metadata.version(name) == version
    wsproto_compat.check()


def test_a_connection_in_its_handshake_keeps_it() -> None:
    server = WSConnection(ConnectionType.SERVER)
    handshake = server.handshake
    assert wsproto_compat.release_handshake(server) is False
    assert server.handshake is handshake


def test_a_released_server_connection_exchanges_messages_and_closes() -> None:
    client, server = open_pair()
    assert wsproto_compat.release_handshake(server) is True
    assert server.handshake is wsproto_compat.RELEASED
    server.receive_data(client.send(TextMessage(data="one")) + client.send(TextMessage(data="two")))
    assert [e.data for e in server.events() if isinstance(e, TextMessage)] == ["one", "two"]
    client.receive_data(server.send(TextMessage(data="three")))
    assert [e.data for e in client.events() if isinstance(e, TextMessage)] == ["three"]
    client.receive_data(server.send(CloseConnection(code=1000)))
    assert [e.code for e in client.events() if isinstance(e, CloseConnection)] == [1000]


def test_the_check_fails_loudly_when_events_come_from_the_handshake_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def handshake_only(self: WSConnection) -> Iterator[Event]:
        # An upgrade whose connection routes everything through its handshake object.
        yield from self.handshake.events()

    monkeypatch.setattr(WSConnection, "events", handshake_only)
    with pytest.raises(CompatError) as info:
        wsproto_compat.check()
    assert "crush_trio._compat.wsproto" in str(info.value)
    assert "checked against wsproto 1.3.2" in str(info.value)


def test_the_check_fails_loudly_when_the_state_asks_the_handshake(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def state(self: Any) -> Any:
        return self.handshake.state  # the stand-in has none

    monkeypatch.setattr(WSConnection, "state", property(state))
    with pytest.raises(CompatError):
        wsproto_compat.check()
