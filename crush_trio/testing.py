"""pytest plugin: trio integration tests against a real crush_trio server, in a few lines.

Installed with the package (entry point ``pytest11``), so a project that depends on crush_trio and
runs pytest-trio gets these fixtures without any import:

``scripted_model``
    The :class:`~crush_trio.providers.scripted.ScriptedModel` every model call of the server goes
    to: queue replies, tool calls and errors with ``scripted_model.add(Step(...))``, and hold a run
    at a chosen phase with a :class:`~crush_trio.providers.scripted.Gate`. With no step queued it
    echoes the prompt.
``crush_config``
    A ``crush.json`` document (default ``{}``) for the server; override this fixture to change the
    server's bounds, e.g. ``{"server": {"replay_buffer": 2}}``.
``crush_server``
    A :class:`CrushServer`: a real server started inside the test's trio run, listening on
    ``127.0.0.1`` port 0 with its data and config under a temporary directory, plugged into
    ``scripted_model``. It is stopped gracefully after the test (runs cancelled, state saved).
``crush_client``
    A :class:`~crush_trio.client.Client` connected to ``crush_server``.
``crush_workspace``
    A :class:`~crush_trio.client.WorkspaceClient` on a new project directory of ``crush_server``.

A test that waits for a run which never ends fails with the client's
:class:`~crush_trio.client.Timeout` ("run ... did not end within ..."), and the report gets a
``crush_trio`` section with the scripted model's state, naming any
:class:`~crush_trio.providers.scripted.Gate` that a run reached and the test never released.

``autojump_clock``: the server is real (sockets, and SQLite in a worker thread). While a worker
thread runs, nothing in the trio run is runnable, so an autojumping clock would leap to the next
deadline and fire timeouts that real time would never reach. While these fixtures are in use, any
``trio.to_thread.run_sync`` call therefore holds the clock still (the autojump threshold is raised
until the thread returns); loopback socket traffic is ready at once and needs nothing. The caveat
that remains: other waits on the outside world (a subprocess, a real model provider) still let
virtual time jump, and ``trio.testing.wait_all_tasks_blocked`` can return while a database call
is in flight, so wait on events (run ends, gates reached) rather than on idleness.
"""

from __future__ import annotations

import collections
import math
import uuid
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import attrs
import orjson
import pytest
import trio
from trio.testing import MockClock

from .client import Client, Timeout, WorkspaceClient, connect
from .errors import unwrap_group
from .providers.scripted import Gate, ScriptedModel, Step

if TYPE_CHECKING:
    # Only annotates CrushServer (never structured): the server's code loads in crush_server.
    from collections.abc import AsyncIterator, Iterable

    from .server.serve import ServerHandle  # noqa: TC004

__all__ = [
    "CrushServer",
    "crush_client",
    "crush_config",
    "crush_server",
    "crush_workspace",
    "scripted_model",
]

#: Token of the test server.
TEST_TOKEN: Final = "crush-trio-test-token"
#: Bound on the graceful stop of the test server at teardown (seconds, trio clock).
STOP_TIMEOUT: Final = 60.0


@attrs.define
class CrushServer:
    """The test server of ``crush_server``.

    Attributes:
        handle: the running server (URL, token, backend).
        model: the scripted model (the same object as the ``scripted_model`` fixture).
        root: a temporary directory for this server's projects, data and config.
    """

    handle: ServerHandle
    model: ScriptedModel
    root: Path

    @property
    def url(self) -> str:
        return self.handle.url

    @property
    def token(self) -> str:
        return self.handle.token

    @property
    def backend(self) -> Any:
        return self.handle.backend

    def project(self, name: str | None = None) -> Path:
        """A new, empty project directory to open as a workspace."""
        path = self.root / "projects" / (name or f"project-{uuid.uuid4().hex[:8]}")
        path.mkdir(parents=True)
        return path

    def stop(self) -> None:
        """Begin the graceful stop (the fixture also does this at teardown)."""
        self.handle.stop()


class _ClockHold:
    """Holds an autojumping MockClock still while worker threads run (see the module docs)."""

    def __init__(self, clock: MockClock) -> None:
        self.clock = clock
        self.pending = 0
        self.saved = clock.autojump_threshold
        self.original = trio.to_thread.run_sync

    async def run_sync(self, *args: Any, **kwargs: Any) -> Any:
        if self.pending == 0:
            self.saved = self.clock.autojump_threshold
            self.clock.autojump_threshold = math.inf
        self.pending += 1
        try:
            return await self.original(*args, **kwargs)
        finally:
            self.pending -= 1
            if self.pending == 0:
                self.clock.autojump_threshold = self.saved


class _UsedSteps(collections.deque[Step]):
    """The model's step queue, remembering the steps taken (to report unreleased gates)."""

    def __init__(self, steps: Iterable[Step]) -> None:
        super().__init__(steps)
        self.used: list[Step] = []

    def popleft(self) -> Step:
        step = super().popleft()
        self.used.append(step)
        return step


@pytest.fixture
def scripted_model() -> ScriptedModel:
    """The scripted model the ``crush_server`` fixture's server uses for every model call."""
    model = ScriptedModel()
    model.steps = _UsedSteps(model.steps)
    return model


@pytest.fixture
def crush_config() -> dict[str, Any]:
    """The server's ``crush.json`` (default empty); override it to configure the server."""
    return {}


@pytest.fixture
def crush_provider_factory(scripted_model: ScriptedModel) -> Any:
    """What builds the server's model providers: ``scripted_model`` by default. Override it with
    ``None`` to use the providers configured in ``crush_config`` (real HTTP providers, echo)."""
    return scripted_model


@pytest.fixture
async def crush_server(
    tmp_path: Path,
    scripted_model: ScriptedModel,
    crush_config: dict[str, Any],
    crush_provider_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[CrushServer]:
    """A real server in the test's trio run on ``127.0.0.1:0`` (models from
    ``crush_provider_factory``: the scripted model unless overridden)."""
    # Imported here so that merely installing the plugin does not load the server's code.
    from .server.serve import ServeOptions, serve

    clock = trio.lowlevel.current_clock()
    if isinstance(clock, MockClock):
        hold = _ClockHold(clock)
        monkeypatch.setattr(trio.to_thread, "run_sync", hold.run_sync)
    root = tmp_path / "crush-trio"
    root.mkdir()
    config_file = None
    if crush_config:
        config_file = root / "crush.json"
        config_file.write_bytes(orjson.dumps(crush_config))
    options = ServeOptions(
        host="127.0.0.1",
        port=0,
        data_dir=root / "data",
        config_file=config_file,
        token=TEST_TOKEN,
        user_config_dir=root / "user-config",
        access_log=False,
        provider_factory=crush_provider_factory,
    )
    async with trio.open_nursery() as nursery:
        handle: ServerHandle = await nursery.start(partial(serve, options))
        server = CrushServer(handle, scripted_model, root)
        try:
            yield server
        finally:
            handle.stop()
            nursery.cancel_scope.deadline = trio.current_time() + STOP_TIMEOUT
    if nursery.cancel_scope.cancelled_caught:
        pytest.fail(f"crush_server did not stop within {STOP_TIMEOUT:g} s after the test")


@pytest.fixture
async def crush_client(crush_server: CrushServer) -> AsyncIterator[Client]:
    """A client connected to ``crush_server``."""
    async with connect(crush_server.url, crush_server.token) as client:
        yield client


@pytest.fixture
async def crush_workspace(
    crush_server: CrushServer, crush_client: Client
) -> AsyncIterator[WorkspaceClient]:
    """A workspace of ``crush_server`` on a new project directory, opened by ``crush_client``."""
    async with crush_client.workspace(crush_server.project()) as ws:
        yield ws


def _held(gate: Gate | None) -> bool:
    return gate is not None and gate.reached.is_set() and not gate._open.is_set()


def describe_model(model: ScriptedModel) -> str:
    """The scripted model's state, for a failure report."""
    lines = [
        f"scripted model: {len(model.requests)} model call(s) made, "
        f"{len(model.steps)} scripted step(s) not used yet."
    ]
    used = model.steps.used if isinstance(model.steps, _UsedSteps) else []
    for number, step in enumerate(used, 1):
        for name in ("gate_before", "gate_mid"):
            if _held(getattr(step, name)):
                lines.append(
                    f"step {number} (text {step.text!r}) reached its {name} and it was never "
                    "released, so its run could not finish: call gate.release()."
                )
    return "\n".join(lines)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    excinfo = call.excinfo
    if excinfo is None or call.when != "call":
        return report
    timeout = unwrap_group(excinfo.value)
    if not isinstance(timeout, Timeout):
        return report
    funcargs = getattr(item, "funcargs", {})
    model = funcargs.get("scripted_model")
    text = f"crush_trio: {timeout}"
    if isinstance(model, ScriptedModel):
        text += "\n" + describe_model(model)
    report.sections.append(("crush_trio", text))
    return report
