"""Run-completion webhooks: signed POSTs from a persisted, bounded outbox (docs/webhooks.md).

Every test POSTs to a real HTTP receiver on a loopback port, served in the test's nursery
(:class:`Receiver`, on h11). Backoff delays are not waited for: the outbox's ``sleep`` is
replaced by one that records the delay and returns, so the delays are checked exactly and the
tests take no wall time beyond the sockets' (a receiver that never answers costs one
``webhook_timeout`` of real time, set small).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import socket
import time
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import h11
import orjson
import pytest
import trio

from crush_trio.config import (
    WEBHOOK_SECRET_FILE_MAX_BYTES,
    ServerOptions,
    load_config_report,
)
from crush_trio.errors import ConfigError
from crush_trio.metrics import METRICS
from crush_trio.webhooks import OUTBOX_FILENAME, Endpoint, OutboxFile, Webhooks, policy
from crush_trio.wire import RunComplete

from .conftest import WAIT

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable
    from pathlib import Path

    from crush_trio.client import Client
    from crush_trio.testing import CrushServer

SECRET = b"webhook-test-secret"

# -- a real HTTP receiver ---------------------------------------------------------------------

#: One answer of the receiver: a status (with headers), or a behaviour.
Answer = tuple[int, dict[str, str]] | str


@attrs.define
class Received:
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


@attrs.define(eq=False)
class Receiver:
    """An HTTP endpoint that records each POST and answers from :attr:`answers` (then 200).

    Answers: ``(status, headers)``; ``"hang"`` reads the request and never answers;
    ``"huge"`` answers 200 with an endless body; ``"close"`` closes the connection unanswered.
    """

    url: str = ""
    answers: list[Answer] = attrs.field(factory=list)
    requests: list[Received] = attrs.field(factory=list)
    hanging: int = 0
    _changed: trio.Event = attrs.field(factory=trio.Event)

    async def wait_for(self, count: int) -> list[Received]:
        with trio.fail_after(WAIT):
            while len(self.requests) < count:
                await self._changed.wait()
        return self.requests

    async def handle(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        headers: dict[str, str] = {}
        body = b""
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    conn.receive_data(data)
                    if not data and conn.their_state is not h11.DONE:
                        return
                    continue
                if isinstance(event, h11.Request):
                    headers = {k.decode().lower(): v.decode() for k, v in event.headers}
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
            self.requests.append(Received(headers, body))
            self._changed.set()
            self._changed = trio.Event()
            answer = self.answers.pop(0) if self.answers else (200, {})
            if answer == "close":
                return
            if answer == "hang":
                self.hanging += 1
                await trio.sleep_forever()
            if answer == "huge":
                head = h11.Response(status_code=200, headers=[("Content-Length", str(1 << 40))])
                await stream.send_all(conn.send(head) or b"")
                chunk = b"x" * 65536
                while True:  # until the client goes away
                    await stream.send_all(chunk)
            assert isinstance(answer, tuple)
            status, extra = answer
            response = h11.Response(
                status_code=status,
                headers=[("Content-Length", "2"), *extra.items()],
            )
            await stream.send_all(
                (conn.send(response) or b"")
                + (conn.send(h11.Data(data=b"ok")) or b"")
                + (conn.send(h11.EndOfMessage()) or b"")
            )
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
            pass
        finally:
            await stream.aclose()


async def start_receiver(
    nursery: trio.Nursery, receiver: Receiver, port: int = 0, path: str = "/hook"
) -> Receiver:
    listeners = await nursery.start(
        partial(trio.serve_tcp, receiver.handle, port, host="127.0.0.1")
    )
    bound = listeners[0].socket.getsockname()[1]
    receiver.url = f"http://127.0.0.1:{bound}{path}"
    return receiver


def free_port() -> int:
    """A loopback port nothing listens on (a POST to it is refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# -- the outbox on its own ---------------------------------------------------------------------


@attrs.define
class Clockless:
    """The outbox's ``sleep``: records each delay and returns at once."""

    delays: list[float] = attrs.field(factory=list)

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        await trio.lowlevel.checkpoint()


def options(**overrides: Any) -> ServerOptions:
    base: dict[str, Any] = {
        "webhook_backoff_base": 1.0,
        "webhook_backoff_max": 60.0,
        "webhook_max_attempts": 5,
        "webhook_timeout": 5.0,
    }
    return ServerOptions(**{**base, **overrides})


def complete(run_id: str = "r1", **fields: Any) -> RunComplete:
    return RunComplete("s1", run_id, "m1", fields.pop("text", "the reply"), **fields)


def endpoint(url: str, **fields: Any) -> Endpoint:
    return Endpoint(url, SECRET, **fields)


async def no_secret(scope: str, url: str) -> bytes | None:
    return None


@pytest.fixture
def outbox_file(tmp_path: Path) -> Path:
    return tmp_path / "data" / OUTBOX_FILENAME


def webhooks(
    path: Path,
    *,
    sleep: Callable[[float], Awaitable[None]] | None = None,
    resolve: Callable[[str, str], Awaitable[bytes | None]] = no_secret,
    **overrides: Any,
) -> Webhooks:
    return Webhooks(
        options(**overrides),
        path,
        resolve=resolve,
        version="test",
        sleep=sleep or Clockless(),
        draw=lambda: 0.5,
    )


def enqueue(hooks: Webhooks, url: str, run_id: str = "r1", **fields: Any) -> str:
    (delivery_id,) = hooks.enqueue(
        complete(run_id, **fields),
        workspace_id="w1",
        workspace_path="/p",
        endpoints=[endpoint(url)],
    )
    return delivery_id


def metric(outcome: str) -> float:
    value = METRICS.registry.get_sample_value(
        "crush_trio_webhook_deliveries_total", {"outcome": outcome}
    )
    return value or 0.0


def latency_count() -> float:
    return METRICS.registry.get_sample_value("crush_trio_webhook_latency_seconds_count") or 0.0


def pending_gauge() -> float:
    return METRICS.registry.get_sample_value("crush_trio_webhook_pending") or 0.0


async def settle(hooks: Webhooks, predicate: Callable[[], bool]) -> None:
    with trio.fail_after(WAIT):
        await hooks.wait_until(predicate)


async def test_failing_twice_with_503_then_200_takes_three_attempts_with_growing_delays(
    outbox_file: Path,
) -> None:
    sleep = Clockless()
    before = {o: metric(o) for o in ("retry", "delivered")}
    posts = latency_count()
    async with trio.open_nursery() as nursery:
        receiver = await start_receiver(nursery, Receiver(answers=[(503, {}), (503, {})]))
        hooks = await nursery.start(webhooks(outbox_file, sleep=sleep).run)
        delivery_id = enqueue(hooks, receiver.url)
        await settle(hooks, lambda: hooks.delivered == 1)
        requests = await receiver.wait_for(3)
        nursery.cancel_scope.cancel()
    assert [r.headers["x-crush-trio-attempt"] for r in requests] == ["1", "2", "3"]
    assert {r.headers["x-crush-trio-delivery"] for r in requests} == {delivery_id}
    assert {r.body for r in requests} == {requests[0].body}
    # base 1 s doubling, jitter factor 1 - 0.25 * 0.5
    assert sleep.delays == [pytest.approx(0.875), pytest.approx(1.75)]
    assert hooks.attempts == 3
    assert hooks.retried == 2
    assert hooks.failed == 0
    assert metric("retry") - before["retry"] == 2
    assert metric("delivered") - before["delivered"] == 1
    assert latency_count() - posts == 3


async def test_retry_after_is_honoured_up_to_the_backoff_cap(outbox_file: Path) -> None:
    sleep = Clockless()
    answers: list[Answer] = [(429, {"Retry-After": "7"}), (503, {"Retry-After": "3600"})]
    async with trio.open_nursery() as nursery:
        receiver = await start_receiver(nursery, Receiver(answers=answers))
        hooks = await nursery.start(webhooks(outbox_file, sleep=sleep).run)
        enqueue(hooks, receiver.url)
        await settle(hooks, lambda: hooks.delivered == 1)
        nursery.cancel_scope.cancel()
    assert sleep.delays == [7.0, 60.0]


async def test_a_400_is_a_permanent_failure_kept_for_inspection(outbox_file: Path) -> None:
    before = metric("failed")
    async with trio.open_nursery() as nursery:
        receiver = await start_receiver(nursery, Receiver(answers=[(400, {})]))
        hooks = await nursery.start(webhooks(outbox_file).run)
        delivery_id = enqueue(hooks, receiver.url)
        await settle(hooks, lambda: hooks.failed == 1)
        nursery.cancel_scope.cancel()
    assert len(receiver.requests) == 1
    assert hooks.attempts == 1
    assert metric("failed") - before == 1
    box = await OutboxFile.open(outbox_file)
    try:
        (failed,) = await box.failed()
        assert await box.pending() == []
    finally:
        await box.aclose()
    assert failed.id == delivery_id
    assert failed.last_error == "HTTP 400"
    assert failed.attempts == 1


async def test_gives_up_after_max_attempts(outbox_file: Path) -> None:
    async with trio.open_nursery() as nursery:
        receiver = await start_receiver(nursery, Receiver(answers=[(500, {})] * 10))
        hooks = await nursery.start(webhooks(outbox_file, webhook_max_attempts=3).run)
        enqueue(hooks, receiver.url)
        await settle(hooks, lambda: hooks.failed == 1)
        nursery.cancel_scope.cancel()
    assert len(receiver.requests) == 3
    assert hooks.pending == []


async def test_failed_deliveries_kept_are_bounded(outbox_file: Path) -> None:
    async with trio.open_nursery() as nursery:
        receiver = await start_receiver(nursery, Receiver(answers=[(410, {})] * 5))
        hooks = await nursery.start(webhooks(outbox_file, webhook_failed_kept=2).run)
        ids = [enqueue(hooks, receiver.url, f"r{i}") for i in range(5)]
        await settle(hooks, lambda: hooks.failed == 5 and not hooks._dirty)
        nursery.cancel_scope.cancel()
    box = await OutboxFile.open(outbox_file)
    try:
        kept = await box.failed()
    finally:
        await box.aclose()
    assert len(kept) == 2
    assert {d.id for d in kept} <= set(ids)


async def test_a_pending_delivery_survives_a_restart(outbox_file: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/hook"
    # First server: the endpoint is down; the retry waits (for real) when the server stops.
    async with trio.open_nursery() as nursery:
        hooks = await nursery.start(webhooks(outbox_file, sleep=trio.sleep).run)
        delivery_id = enqueue(hooks, url)
        await settle(hooks, lambda: hooks.retried == 1)
        nursery.cancel_scope.cancel()
    assert hooks.delivered == 0
    assert hooks.failed == 0
    box = await OutboxFile.open(outbox_file)
    try:
        (stored,) = await box.pending()
    finally:
        await box.aclose()
    assert stored.id == delivery_id
    assert stored.attempts == 1
    assert "ConnectError" in stored.last_error
    assert stored.secret is None

    # Second server: the endpoint is up; the secret comes from the configuration again.
    asked: list[tuple[str, str]] = []

    async def resolve(scope: str, target: str) -> bytes | None:
        asked.append((scope, target))
        return SECRET

    sleep = Clockless()
    async with trio.open_nursery() as nursery:
        receiver = await start_receiver(nursery, Receiver(), port=port)
        assert receiver.url == url
        again = webhooks(outbox_file, sleep=sleep, resolve=resolve)
        await nursery.start(again.run)
        await settle(again, lambda: again.delivered == 1 and not again._dirty)
        nursery.cancel_scope.cancel()
    (request,) = receiver.requests
    assert request.headers["x-crush-trio-delivery"] == delivery_id
    assert request.headers["x-crush-trio-attempt"] == "2"
    assert asked == [("", url)]
    # It waited out the rest of the backoff the first server had chosen (about 0.875 s).
    assert len(sleep.delays) == 1
    assert 0 < sleep.delays[0] <= 0.875
    box = await OutboxFile.open(outbox_file)
    try:
        assert await box.pending() == []
        assert await box.failed() == []
    finally:
        await box.aclose()


async def test_a_post_in_flight_at_shutdown_stays_pending(outbox_file: Path) -> None:
    async with trio.open_nursery() as nursery:
        receiver = await start_receiver(nursery, Receiver(answers=["hang"]))
        hooks = await nursery.start(webhooks(outbox_file).run)
        delivery_id = enqueue(hooks, receiver.url)
        await receiver.wait_for(1)
        nursery.cancel_scope.cancel()
    assert hooks.attempts == 0
    assert hooks.failed == 0
    box = await OutboxFile.open(outbox_file)
    try:
        (stored,) = await box.pending()
    finally:
        await box.aclose()
    # The cut attempt is not counted: the next start sends attempt 1 again, same delivery id.
    assert stored.id == delivery_id
    assert stored.attempts == 0


async def test_a_delivery_whose_endpoint_is_gone_after_a_restart_fails(outbox_file: Path) -> None:
    async with trio.open_nursery() as nursery:
        hooks = await nursery.start(webhooks(outbox_file, sleep=trio.sleep).run)
        enqueue(hooks, f"http://127.0.0.1:{free_port()}/hook")
        await settle(hooks, lambda: hooks.retried == 1)
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:
        again = webhooks(outbox_file, resolve=no_secret)
        await nursery.start(again.run)
        await settle(again, lambda: again.failed == 1)
        nursery.cancel_scope.cancel()
    assert again.attempts == 0


def write_garbage(path: Path) -> None:
    path.parent.mkdir(parents=True)
    path.write_bytes(b"this is not a database" * 100)


async def test_a_damaged_outbox_file_does_not_stop_deliveries(
    outbox_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_garbage(outbox_file)
    async with trio.open_nursery() as nursery:
        receiver = await start_receiver(nursery, Receiver())
        hooks = await nursery.start(webhooks(outbox_file).run)
        enqueue(hooks, receiver.url)
        await settle(hooks, lambda: hooks.delivered == 1)
        nursery.cancel_scope.cancel()
    assert "pending deliveries are not resumed" in caplog.text
    assert "deliveries go on from memory" in caplog.text


async def test_the_outbox_bound_drops_the_oldest_pending(outbox_file: Path) -> None:
    before = metric("dropped")
    gauge = pending_gauge()
    url = f"http://127.0.0.1:{free_port()}/hook"
    async with trio.open_nursery() as nursery:
        hooks = await nursery.start(
            webhooks(outbox_file, sleep=trio.sleep, webhook_outbox_max=3).run
        )
        ids = [enqueue(hooks, url, f"r{i}") for i in range(5)]
        assert [d.id for d in hooks.pending] == ids[2:]
        assert hooks.dropped == 2
        assert metric("dropped") - before == 2
        assert pending_gauge() - gauge == 3
        await settle(hooks, lambda: hooks.retried == 3)
        nursery.cancel_scope.cancel()
    assert pending_gauge() == gauge
    box = await OutboxFile.open(outbox_file)
    try:
        assert [d.id for d in await box.pending()] == ids[2:]
    finally:
        await box.aclose()


async def test_the_outbox_byte_bound_drops_the_oldest_pending(outbox_file: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/hook"
    async with trio.open_nursery() as nursery:
        hooks = await nursery.start(
            webhooks(outbox_file, sleep=trio.sleep, webhook_outbox_bytes=5000).run
        )
        ids = [enqueue(hooks, url, f"r{i}", text="x" * 1200) for i in range(5)]
        sizes = {len(d.body) for d in hooks.pending}
        assert max(sizes) * 3 <= 5000 < min(sizes) * 4  # three fit
        assert [d.id for d in hooks.pending] == ids[2:]
        assert hooks.dropped == 2
        nursery.cancel_scope.cancel()


async def test_hostile_receivers(outbox_file: Path) -> None:
    """A huge answer is not read; a redirect is not followed (permanent failure); an endpoint
    that never answers costs one timeout per attempt."""
    async with trio.open_nursery() as nursery:
        elsewhere = await start_receiver(nursery, Receiver())
        hostile = await start_receiver(
            nursery,
            Receiver(answers=["huge", (302, {"Location": elsewhere.url}), "hang", "hang"]),
        )
        hooks = await nursery.start(
            webhooks(
                outbox_file, webhook_timeout=0.2, webhook_max_attempts=2, webhook_concurrency=1
            ).run
        )
        enqueue(hooks, hostile.url, "huge")
        await settle(hooks, lambda: hooks.delivered == 1)
        enqueue(hooks, hostile.url, "redirect")
        await settle(hooks, lambda: hooks.failed == 1)
        enqueue(hooks, hostile.url, "silent")
        await settle(hooks, lambda: hooks.failed == 2 and not hooks._dirty)
        nursery.cancel_scope.cancel()
    assert elsewhere.requests == []
    assert hooks.attempts == 1 + 1 + 2
    box = await OutboxFile.open(outbox_file)
    try:
        redirect, silent = await box.failed()
    finally:
        await box.aclose()
    assert "redirect" in redirect.last_error
    assert redirect.attempts == 1
    assert "server.webhook_timeout" in silent.last_error
    assert silent.attempts == 2


async def test_a_connection_closed_without_an_answer_is_retried(outbox_file: Path) -> None:
    sleep = Clockless()
    async with trio.open_nursery() as nursery:
        receiver = await start_receiver(nursery, Receiver(answers=["close", (200, {})]))
        hooks = await nursery.start(webhooks(outbox_file, sleep=sleep).run)
        enqueue(hooks, receiver.url)
        await settle(hooks, lambda: hooks.delivered == 1)
        nursery.cancel_scope.cancel()
    assert len(receiver.requests) == 2
    assert hooks.retried == 1
    assert len(sleep.delays) == 1


async def test_a_long_text_is_cut_to_the_body_bound(outbox_file: Path) -> None:
    async with trio.open_nursery() as nursery:
        receiver = await start_receiver(nursery, Receiver())
        hooks = await nursery.start(webhooks(outbox_file, webhook_max_body_bytes=2000).run)
        enqueue(hooks, receiver.url, text="é" * 5000)
        (request,) = await receiver.wait_for(1)
        nursery.cancel_scope.cancel()
    body = request.json()
    assert len(request.body) <= 2000
    assert body["text_truncated"] is True
    assert body["text"]
    assert set(body["text"]) == {"é"}


# -- the policy, as tables --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "verdict"),
    [
        (200, policy.Verdict.DELIVERED),
        (204, policy.Verdict.DELIVERED),
        (301, policy.Verdict.FAILED),
        (400, policy.Verdict.FAILED),
        (401, policy.Verdict.FAILED),
        (404, policy.Verdict.FAILED),
        (408, policy.Verdict.RETRY),
        (429, policy.Verdict.RETRY),
        (500, policy.Verdict.RETRY),
        (503, policy.Verdict.RETRY),
    ],
)
def test_answers_are_judged_by_status(status: int, verdict: policy.Verdict) -> None:
    assert policy.classify(status) is verdict


@pytest.mark.parametrize("char", ["a", "é", "€", "😀", '"', "\x01"])
@pytest.mark.parametrize("max_bytes", [600, 4096])
def test_a_cut_body_fits_its_bound_and_stays_valid_json(char: str, max_bytes: int) -> None:
    data = policy.build_body(
        complete(text=char * 10_000),
        delivery_id="d",
        workspace_id="w",
        workspace_path="/p",
        created_at=0,
        max_bytes=max_bytes,
    )
    body = orjson.loads(data)
    assert len(data) <= max_bytes
    assert body["text_truncated"] is True
    assert body["text"]
    assert set(body["text"]) == {char}
    whole = policy.build_body(
        complete(text=char * 10),
        delivery_id="d",
        workspace_id="w",
        workspace_path="/p",
        created_at=0,
        max_bytes=max_bytes,
    )
    assert orjson.loads(whole)["text_truncated"] is False


def test_retry_after_forms() -> None:
    assert policy.parse_retry_after("120", 0) == 120
    assert policy.parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", 1445412480) == 10
    assert policy.parse_retry_after("soon", 0) is None
    assert policy.parse_retry_after(None, 0) is None


def test_delays_grow_and_stay_under_the_cap() -> None:
    # Whatever the draws, each delay exceeds the one before until the cap (2**8 < 300 < 2**9).
    draws = (0.0, 0.999)
    for first, second in itertools.product(draws, draws):
        for n in range(1, 9):
            now = policy.backoff_delay(n, base=1, cap=300, draw=first)
            after = policy.backoff_delay(n + 1, base=1, cap=300, draw=second)
            assert after > now
    assert policy.backoff_delay(60, base=1, cap=300, draw=0) == 300
    assert policy.backoff_delay(10**6, base=1, cap=300, draw=0.5) <= 300


def test_events_filter_by_outcome() -> None:
    done, failed = complete(), complete(error="boom")
    cancelled = complete(cancelled=True)
    assert policy.wanted(["run_complete"], failed)
    assert policy.wanted(["run_complete.failed"], failed)
    assert not policy.wanted(["run_complete.failed"], done)
    assert not policy.wanted(["run_complete.completed"], cancelled)


def test_logs_show_no_path_or_query_of_an_endpoint() -> None:
    shown = policy.display_url("https://user:pw@hooks.example:8443/T0/B1/secret?token=x")
    assert shown == "https://hooks.example:8443"


# -- configuration and trust ------------------------------------------------------------------


def test_an_untrusted_workspace_cannot_add_endpoints(tmp_path: Path) -> None:
    user = tmp_path / "user"
    user.mkdir()
    project = tmp_path / "project"
    project.mkdir()
    hook = {"url": "http://127.0.0.1:9/hook", "secret": "$HOME"}
    (project / "crush.json").write_bytes(orjson.dumps({"webhooks": [hook]}))
    loaded = load_config_report(config_file=None, workspace=project, user_config_dir=user)
    assert loaded.config.webhooks == []
    assert any("$.webhooks" in w and "untrusted" in w for w in loaded.warnings)
    (user / "crush.json").write_bytes(orjson.dumps({"trusted_workspaces": [str(project)]}))
    loaded = load_config_report(
        config_file=None, workspace=project, user_config_dir=user, env={"HOME": "h0me"}
    )
    (endpoint_config,) = loaded.config.webhooks
    assert endpoint_config.secret == "h0me"
    assert "h0me" not in repr(loaded.config)


def test_secret_file_is_read_and_never_shown(tmp_path: Path) -> None:
    from crush_trio.config import config_to_json

    secret = tmp_path / "hook.secret"
    secret.write_text("  from-a-file\n")
    file = tmp_path / "crush.json"
    file.write_bytes(
        orjson.dumps({"webhooks": [{"url": "https://x.example/h", "secret_file": str(secret)}]})
    )
    config = load_config_report(config_file=file, workspace=None).config
    assert config.webhooks[0].secret == "from-a-file"
    assert config_to_json(config)["webhooks"][0]["secret"] == "***"


def _hostile_secret(tmp_path: Path, kind: str) -> str:
    target = tmp_path / "hook.secret"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "link to a fifo":
        os.mkfifo(tmp_path / "pipe")
        target.symlink_to(tmp_path / "pipe")
    elif kind == "directory":
        target.mkdir()
    elif kind == "oversized":
        target.write_text("x" * (WEBHOOK_SECRET_FILE_MAX_BYTES + 1))
    elif kind == "not UTF-8":
        target.write_bytes(b"\xff\xfe secret")
    elif kind == "empty":
        target.write_text(" \n")
    elif kind == "relative":
        return "hook.secret"
    elif kind == "missing":
        pass
    return str(target)


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("fifo", "name a regular file"),
        ("link to a fifo", "name a regular file"),
        ("directory", "name a regular file"),
        ("oversized", "WEBHOOK_SECRET_FILE_MAX_BYTES"),
        ("not UTF-8", "not UTF-8"),
        ("empty", "is empty"),
        ("relative", "absolute path"),
        ("missing", "cannot read"),
    ],
)
def test_a_secret_file_that_is_not_a_small_text_file_is_a_clear_error(
    tmp_path: Path, kind: str, said: str
) -> None:
    """Never a hang (a FIFO is opened without blocking) and never a crash: an error naming the
    key and what to do."""
    file = tmp_path / "crush.json"
    hook = {"url": "https://x.example/h", "secret_file": _hostile_secret(tmp_path, kind)}
    file.write_bytes(orjson.dumps({"webhooks": [hook]}))
    with pytest.raises(ConfigError) as caught:
        load_config_report(config_file=file, workspace=None)
    assert "secret_file" in str(caught.value)
    assert said in str(caught.value)


# -- through the server -----------------------------------------------------------------------


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    async with trio.open_nursery() as nursery:
        yield await start_receiver(nursery, Receiver())
        nursery.cancel_scope.cancel()


@pytest.fixture
def webhook_events() -> list[str]:
    """The ``events`` of the receiver's endpoint (a test parametrizes it to change them)."""
    return ["run_complete"]


@pytest.fixture
def crush_config(receiver: Receiver, webhook_events: list[str]) -> dict[str, Any]:
    return {
        "webhooks": [{"url": receiver.url, "secret": SECRET.decode(), "events": webhook_events}],
        "server": {"webhook_timeout": 60.0, "webhook_concurrency": 1},
    }


def verify_like_the_docs(secret: bytes, headers: dict[str, str], body: bytes) -> bool:
    """The receiver-side check of docs/webhooks.md, written out."""
    signed = headers["x-crush-trio-timestamp"].encode() + b"." + body
    expected = "sha256=" + hmac.new(secret, signed, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, headers["x-crush-trio-signature"])


async def test_a_run_end_is_posted_once_with_a_valid_signature(
    crush_server: CrushServer, crush_client: Client, receiver: Receiver
) -> None:
    before = metric("delivered")
    project = crush_server.project()
    async with crush_client.workspace(project) as ws:
        session = await ws.create_session()
        handle = await ws.prompt(session.id, "hello hooks", run_id="run-1")
        await handle.result(WAIT)
        (request,) = await receiver.wait_for(1)
        hooks: Webhooks = crush_server.handle.backend.webhooks
        await settle(hooks, lambda: hooks.delivered >= 1 and not hooks.pending)
    assert len(receiver.requests) == 1
    assert verify_like_the_docs(SECRET, request.headers, request.body)
    assert not verify_like_the_docs(b"another secret", request.headers, request.body)
    assert request.headers["content-type"] == "application/json"
    assert request.headers["x-crush-trio-event"] == "run_complete"
    assert abs(int(request.headers["x-crush-trio-timestamp"]) - time.time()) < WAIT
    body = request.json()
    assert body["delivery_id"] == request.headers["x-crush-trio-delivery"]
    assert body["workspace_id"] == ws.id
    assert body["workspace_path"] == str(project.resolve())
    assert body["run_id"] == "run-1"
    assert body["session_id"] == session.id
    assert body["text"] == "hello hooks"
    assert body["outcome"] == "completed"
    assert body["event"] == "run_complete"
    assert body["cancelled"] is False
    assert metric("delivered") - before == 1


async def test_a_hanging_receiver_never_delays_run_complete(
    crush_server: CrushServer, crush_client: Client, receiver: Receiver
) -> None:
    receiver.answers = ["hang"]
    async with crush_client.workspace(crush_server.project()) as ws:
        session = await ws.create_session()
        first = await ws.prompt(session.id, "first", run_id="run-a")
        await first.result(WAIT)
        await receiver.wait_for(1)
        assert receiver.hanging == 1
        # The POST of the first run's end hangs (and holds the only delivery slot): the next
        # run still completes and its clients get run_complete.
        second = await ws.prompt(session.id, "second", run_id="run-b")
        with trio.fail_after(WAIT):
            run = await second.result(WAIT)
        assert second.complete is not None
        assert run.text == "second"
        assert receiver.hanging == 1
        assert len(receiver.requests) == 1
        hooks: Webhooks = crush_server.handle.backend.webhooks
        assert [orjson.loads(d.body)["run_id"] for d in hooks.pending] == ["run-a", "run-b"]


async def test_a_trusted_workspace_adds_endpoints_found_again_after_a_restart(
    tmp_path: Path,
) -> None:
    from crush_trio.backend.registry import Backend
    from crush_trio.config import WebhookConfig

    user = tmp_path / "user"
    user.mkdir()
    project = (tmp_path / "project").resolve()
    project.mkdir()
    own = {"url": "https://own.example/hook", "secret": "own-secret"}
    shared = {"url": "https://server.example/hook", "secret": "ws-copy"}
    (project / "crush.json").write_bytes(orjson.dumps({"webhooks": [shared, own]}))
    (user / "crush.json").write_bytes(orjson.dumps({"trusted_workspaces": [str(project)]}))
    backend = Backend(
        server=ServerOptions(),
        data_dir=tmp_path / "data",
        user_config_dir=user,
        webhooks=[WebhookConfig("https://server.example/hook", secret="server-secret")],
    )
    config = load_config_report(config_file=None, workspace=project, user_config_dir=user).config
    server_hook, ws_hook = backend._endpoints(config, project)
    # The server's own endpoint comes first and is not repeated (same URL).
    assert (server_hook.url, server_hook.scope, server_hook.secret) == (
        "https://server.example/hook",
        "",
        b"server-secret",
    )
    assert (ws_hook.url, ws_hook.scope) == ("https://own.example/hook", str(project))
    # After a restart the workspace is not open: its configuration is read again.
    assert await backend._webhook_secret(str(project), own["url"]) == b"own-secret"
    assert await backend._webhook_secret("", shared["url"]) == b"server-secret"
    assert await backend._webhook_secret("", own["url"]) is None
    # Untrusted now: its file no longer names endpoints, so there is no secret to sign with.
    (user / "crush.json").write_bytes(orjson.dumps({}))
    assert await backend._webhook_secret(str(project), own["url"]) is None


@pytest.mark.parametrize("webhook_events", [["permission_request"]])
async def test_a_permission_request_is_posted_to_endpoints_that_list_it(
    crush_server: CrushServer, crush_client: Client, receiver: Receiver, scripted_model: Any
) -> None:
    from crush_trio.providers.scripted import Step

    scripted_model.add(Step(tool_calls=[("bash", {"command": "touch hooked"})]), Step("done"))
    async with crush_client.workspace(crush_server.project()) as ws:
        session = await ws.create_session()
        handle = await ws.prompt(session.id, "run it", run_id="perm-1")
        asked = await handle.next_permission_request(WAIT)
        assert asked is not None
        (request,) = await receiver.wait_for(1)
        # Only the request was POSTed (the endpoint does not list run_complete): answer it and
        # the run ends without a second POST.
        assert await ws.grant(asked.id, "deny")
        await handle.result(WAIT)
        hooks: Webhooks = crush_server.handle.backend.webhooks
        await settle(hooks, lambda: hooks.delivered >= 1 and not hooks.pending)
    assert len(receiver.requests) == 1
    assert verify_like_the_docs(SECRET, request.headers, request.body)
    assert request.headers["x-crush-trio-event"] == "permission_request"
    body = request.json()
    assert body["event"] == "permission_request"
    assert body["workspace_id"] == ws.id
    assert body["delivery_id"] == request.headers["x-crush-trio-delivery"]
    permission = body["permission"]
    assert permission["id"] == asked.id
    assert permission["session_id"] == session.id
    assert permission["tool_name"] == "bash"
    assert permission["params"]["command"] == "touch hooked"
    assert body["params_truncated"] is False


def test_a_large_permission_request_leaves_its_params_out() -> None:
    from crush_trio.wire import PermissionRequest

    request = PermissionRequest(
        id="p",
        session_id="s",
        tool_call_id="c",
        tool_name="write",
        description="d" * 5000,
        action="write",
        params={"path": "big.txt", "content": "x" * 100_000},
        path="/w/big.txt",
    )
    body = policy.build_permission_body(
        request,
        delivery_id="d",
        workspace_id="w",
        workspace_path="/w",
        created_at=1,
        max_bytes=4096,
    )
    assert len(body) <= 4096
    data = orjson.loads(body)
    assert data["params_truncated"] is True
    assert data["permission"]["params"] == {}
    assert data["permission"]["description"] == "d" * policy.PERMISSION_DESCRIPTION_CHARS
    assert policy.event_of(body) == "permission_request"
