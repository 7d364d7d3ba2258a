"""``crush-trio run``: send one prompt, print its reply, exit with a code that says how it went.

It is built on :mod:`crush_trio.client` and follows PROTOCOL §8 (flags, exit codes); see
``docs/cli.md`` for the user's view. The order of work:

1. Parse and validate (usage errors exit 2 before anything is contacted).
2. Connect to ``--server`` (or ``CRUSH_TRIO_SERVER``), or start an embedded server in this
   process when none is named; open the workspace, whose event stream is open from then on.
3. Pick the session (``-s`` prefix, ``-C`` the latest, or a new one) and print its id to stderr.
4. Send the prompt with a new UUID ``run_id``; the run handle was subscribed before sending.
5. Stream the run's own events: text mode prints the reply as it grows, each ``message_delta``'s
   text as it comes (the client asks for deltas; a server that sends snapshots only works the
   same), and finishes from ``run_complete.text`` (:class:`~crush_trio.client.Transcript`); json
   mode prints each event as received (``message_delta`` events included) and then the final run
   record.

Interrupts (SIGINT) and ``--timeout`` cancel the run on the server and wait at most
:data:`CANCEL_WAIT` for its cancelled terminal before exiting.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import time
import uuid
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TextIO

import attrs
import orjson
import trio

from . import wire
from .attachments import attachment_from_file
from .client import (
    AuthError,
    Client,
    CrushError,
    Event,
    NotFound,
    RunHandle,
    ShuttingDown,
    Timeout,
    Transcript,
    Unreachable,
    WorkspaceClient,
    connect,
    parse_server_url,
)
from .client.errors import BadRequest
from .wire import AgentEvent, Attachment, RunComplete, Session

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_UNREACHABLE: Final = 3
EXIT_INTERRUPTED: Final = 130

ENV_SERVER: Final = "CRUSH_TRIO_SERVER"
ENV_TOKEN: Final = "CRUSH_TRIO_TOKEN"

#: After an interrupt or ``--timeout``: how long to wait for the run's cancelled terminal.
CANCEL_WAIT: Final = 5.0
#: After an error event of our run: how long to wait for its ``run_complete`` before exiting.
ERROR_GRACE: Final = 5.0
#: Bound on reading the final run record for ``--format json`` (seconds).
RECORD_TIMEOUT: Final = 10.0
#: Spinner frame interval (seconds).
SPINNER_INTERVAL: Final = 0.1
SPINNER_FRAMES: Final = "|/-\\"


class UsageError(Exception):
    """A usage error: exit 2 with this message."""


@attrs.define
class RunOptions:
    """The validated flags of ``crush-trio run``."""

    prompt: str
    server: str | None = None
    token: str | None = None
    workspace: Path = attrs.field(factory=Path.cwd)
    session: str | None = None
    continue_last: bool = False
    model: str | None = None
    yolo: bool = False
    quiet: bool = False
    format: str = "text"
    timeout: float | None = None
    #: Files sent with the prompt (``--attach``).
    attachments: list[Attachment] = attrs.field(factory=list)
    #: Show the embedded server's log on stderr (``--verbose``).
    verbose: bool = False
    #: Print the run's diff at the end (``--diff``).
    diff: bool = False


def add_run_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``run`` command to the ``crush-trio`` argument parser."""
    p = sub.add_parser(
        "run",
        help="send one prompt and print the reply",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Send one prompt and print the reply. Without --server (or CRUSH_TRIO_SERVER) an\n"
            "embedded server is started for the one run.\n\n"
            "examples:\n"
            '  crush-trio run "explain main.py"\n'
            '  git diff | crush-trio run "review this change"\n'
            '  crush-trio run -C "now add a test"          continue the latest session\n'
            '  crush-trio run --format json "list the files" | jq .\n\n'
            "exit codes: 0 completed (or cancelled by someone else), 1 the run failed,\n"
            "2 usage error, 3 server unreachable or authentication failed, 130 interrupted."
        ),
    )
    p.add_argument("prompt", nargs="*", help="the prompt (stdin, when piped, is put before it)")
    _add_server_flags(p)
    p.add_argument(
        "-s",
        "--session",
        default=None,
        help="continue this session: its id, or a unique prefix (`crush-trio sessions` lists them)",
    )
    p.add_argument(
        "-C", "--continue", dest="continue_last", action="store_true", help="most recent session"
    )
    p.add_argument(
        "-m",
        "--model",
        default=None,
        metavar="PROVIDER/MODEL",
        help="the model for this prompt (default: the workspace's models.large)",
    )
    p.add_argument("--yolo", action="store_true", help="approve this run's own permission requests")
    p.add_argument("-q", "--quiet", action="store_true", help="no spinner")
    p.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="output format (default: text)",
    )
    p.add_argument(
        "--timeout", type=float, default=None, help="overall bound in seconds (default: none)"
    )
    p.add_argument(
        "--attach",
        action="append",
        default=[],
        metavar="FILE",
        help="send FILE with the prompt (an image or a text file; repeatable)",
    )
    p.add_argument(
        "--diff",
        action="store_true",
        help="print the files the run changed and their unified diff at the end",
    )
    p.set_defaults(run=run_command)


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    """``--server``, ``--token``, ``--workspace`` and ``--verbose``: where the command runs."""
    p.add_argument(
        "--server",
        default=None,
        help=f"server URL (default: ${ENV_SERVER}, else an embedded server)",
    )
    p.add_argument("--token", default=None, help=f"server token (default: ${ENV_TOKEN})")
    p.add_argument(
        "--workspace", type=Path, default=None, help="project directory (default: the current one)"
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show the embedded server's log on stderr (default: only errors of the command)",
    )


def add_sessions_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``sessions`` command to the ``crush-trio`` argument parser."""
    p = sub.add_parser(
        "sessions",
        help="list the workspace's sessions",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "List the sessions of a workspace, most recently updated first: id, last update,\n"
            "message count and title. Continue one with `crush-trio run -s ID` (a unique prefix\n"
            "of the id is enough)."
        ),
    )
    _add_server_flags(p)
    p.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="output format (default: text)",
    )
    p.set_defaults(run=sessions_command)


def build_options(
    args: argparse.Namespace, stdin: TextIO | None, env: dict[str, str] | None = None
) -> RunOptions:
    """Validate the parsed flags and assemble the prompt (stdin first, then the arguments).

    Raises:
        UsageError: empty prompt, conflicting flags, bad ``--model`` or ``--timeout``, or a
            workspace that is not a directory.
    """
    env = dict(os.environ) if env is None else env
    piped = ""
    if stdin is not None and not stdin.isatty():
        piped = stdin.read().rstrip("\n")
    words = " ".join(args.prompt or [])
    prompt = "\n\n".join(part for part in (piped, words) if part.strip())
    attachments = [_read_attachment(path) for path in getattr(args, "attach", None) or []]
    if not prompt.strip() and not attachments:
        raise UsageError("no prompt: give it as arguments or pipe it on stdin")
    if args.session and args.continue_last:
        raise UsageError("--session and --continue both pick a session; give one of them")
    if args.model is not None:
        provider, _, model = args.model.partition("/")
        if not provider or not model:
            raise UsageError(f"--model {args.model!r} must be provider/model, e.g. echo/echo")
    if args.timeout is not None and not (args.timeout > 0 and math.isfinite(args.timeout)):
        raise UsageError("--timeout must be a positive number of seconds")
    server, token, workspace = _location(args, env)
    return RunOptions(
        prompt=prompt,
        server=server,
        token=token if server is not None else None,
        workspace=workspace,
        session=args.session,
        continue_last=args.continue_last,
        model=args.model,
        yolo=args.yolo,
        quiet=args.quiet,
        format=args.format,
        timeout=args.timeout,
        diff=bool(getattr(args, "diff", False)),
        attachments=attachments,
        verbose=bool(getattr(args, "verbose", False)),
    )


def _location(args: argparse.Namespace, env: dict[str, str]) -> tuple[str | None, str | None, Path]:
    """The server (``None``: embedded), its token and the workspace that the flags name.

    Raises:
        UsageError: ``--token`` without a server, a bad server URL, or a workspace that is not a
            directory.
    """
    server = args.server or env.get(ENV_SERVER) or None
    token = args.token if args.token is not None else env.get(ENV_TOKEN)
    if args.token is not None and server is None:
        raise UsageError(f"--token needs --server (or {ENV_SERVER})")
    if server is not None:
        try:
            parse_server_url(server)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    workspace = (args.workspace or Path.cwd()).absolute()
    if not workspace.is_dir():
        raise UsageError(f"--workspace {workspace} is not a directory")
    return server, token if server is not None else None, workspace


@asynccontextmanager
async def open_client(
    server: str | None, token: str | None, *, verbose: bool = False
) -> AsyncIterator[Client]:
    """A client of ``server``, or of an embedded server started for the block when ``None``.

    The embedded server's log reaches stderr only when ``verbose``: the command's own messages
    are what a user of ``run`` reads there.
    """
    if server is not None:
        async with connect(server, token) as client:
            yield client
        return
    # Imported here: a client of a remote server does not need the server's code.
    from .embedded import embedded
    from .logs import configure_logging
    from .server.serve import ServeOptions

    if verbose:
        configure_logging("INFO", "text", sys.stderr)
    else:
        logging.getLogger().addHandler(logging.NullHandler())  # no last-resort log lines
    async with embedded(ServeOptions(access_log=False)) as client:
        yield client


def sessions_command(args: argparse.Namespace) -> int:
    """The ``sessions`` command (``args.run`` of the CLI); returns the exit code."""
    try:
        server, token, workspace = _location(args, dict(os.environ))
    except UsageError as exc:
        print(f"crush-trio sessions: {exc}", file=sys.stderr)
        return EXIT_USAGE

    async def main() -> int:
        try:
            async with (
                open_client(server, token, verbose=args.verbose) as client,
                client.workspace(workspace) as ws,
            ):
                sessions = await ws.sessions()
        except (Unreachable, AuthError, ShuttingDown, Timeout) as exc:
            print(f"crush-trio sessions: {exc}", file=sys.stderr)
            return EXIT_UNREACHABLE
        except CrushError as exc:
            print(f"crush-trio sessions: {exc}", file=sys.stderr)
            return EXIT_FAILED
        write_sessions(sessions, args.format, sys.stdout)
        return EXIT_OK

    try:
        return trio.run(main)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def write_sessions(sessions: list[Session], fmt: str, out: TextIO) -> None:
    """Print ``sessions``, most recently updated first: a table, or one JSON object a line."""
    ordered = sorted(sessions, key=lambda s: (s.updated_at, s.created_at), reverse=True)
    if fmt == "json":
        for session in ordered:
            out.write(orjson.dumps(wire.converter.unstructure(session)).decode() + "\n")
        return
    if not ordered:
        out.write("no sessions in this workspace yet; `crush-trio run PROMPT` starts one\n")
        return
    for session in ordered:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(session.updated_at))
        title = " ".join(session.title.split()) or "(untitled)"
        out.write(f"{session.id}  {when}  {session.message_count:>4} msgs  {title}\n")


def _read_attachment(path: str) -> Attachment:
    try:
        return attachment_from_file(path)
    except OSError as exc:
        raise UsageError(f"--attach {path}: cannot read it ({exc.strerror or exc})") from None


def run_command(args: argparse.Namespace) -> int:
    """The ``run`` command (``args.run`` of the CLI); returns the exit code."""
    try:
        options = build_options(args, sys.stdin)
    except UsageError as exc:
        print(f"crush-trio run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    runner = Runner(options, sys.stdout, sys.stderr)
    try:
        return trio.run(runner.main)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


class Runner:
    """One ``crush-trio run``: its options, its output streams and its cancel scopes."""

    def __init__(self, options: RunOptions, stdout: TextIO, stderr: TextIO) -> None:
        self.options = options
        self.stdout = stdout
        self.stderr = stderr
        self.interrupted = False
        self.handle: RunHandle | None = None
        self.transcript = Transcript()
        self.outer: trio.CancelScope | None = None
        self.waiting: trio.CancelScope | None = None
        self.sending = False
        self.first_output = trio.Event()
        #: Something was written to stdout (the reply's final newline is written only then).
        self.first_output_written = False
        self.spinning = False

    # -- output ----------------------------------------------------------------------------------

    def out(self, text: str) -> None:
        if text:
            self._clear_spinner()
            self.first_output_written = True
            self.stdout.write(text)
            self.stdout.flush()
            self.first_output.set()

    def json_line(self, data: Any) -> None:
        self.out(orjson.dumps(data).decode() + "\n")

    def err(self, text: str) -> None:
        self._clear_spinner()
        print(text, file=self.stderr, flush=True)

    def _clear_spinner(self) -> None:
        if self.spinning:
            self.stderr.write("\r\x1b[K")
            self.stderr.flush()
            self.spinning = False

    async def _spinner(self) -> None:
        """Show a spinner on stderr until the first output (only on a terminal, not with -q)."""
        frame = 0
        while not self.first_output.is_set():
            self.stderr.write(f"\r{SPINNER_FRAMES[frame % len(SPINNER_FRAMES)]} Generating")
            self.stderr.flush()
            self.spinning = True
            frame += 1
            with trio.move_on_after(SPINNER_INTERVAL):
                await self.first_output.wait()
        self._clear_spinner()

    def _wants_spinner(self) -> bool:
        return not self.options.quiet and bool(getattr(self.stderr, "isatty", lambda: False)())

    # -- the command -----------------------------------------------------------------------------

    async def main(self) -> int:
        """Run the command; returns the exit code."""
        with trio.open_signal_receiver(signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_signals, signals)
                if self._wants_spinner():
                    nursery.start_soon(self._spinner)
                try:
                    code = await self._main()
                finally:
                    self.first_output.set()
                    nursery.cancel_scope.cancel()
        return code

    async def _watch_signals(self, signals: AsyncIterator[int]) -> None:
        async for _ in signals:
            again = self.interrupted
            self.interrupted = True
            if again or (self.waiting is None and not self.sending):
                # Before the prompt was sent, or a second Ctrl-C: stop everything now.
                if self.outer is not None:
                    self.outer.cancel()
            elif self.waiting is not None:
                self.waiting.cancel()
            # While the prompt is being sent, _in_workspace cancels the run once it is accepted.

    async def _main(self) -> int:
        opts = self.options
        deadline = math.inf if opts.timeout is None else trio.current_time() + opts.timeout
        with trio.CancelScope(deadline=deadline) as outer:
            self.outer = outer
            try:
                async with self._client() as client, client.workspace(opts.workspace) as ws:
                    return await self._in_workspace(ws, deadline)
            except UsageError as exc:
                self.err(f"crush-trio run: {exc}")
                return EXIT_USAGE
            except (Unreachable, AuthError, ShuttingDown, Timeout) as exc:
                self.err(f"crush-trio run: {exc}")
                return EXIT_UNREACHABLE
            except CrushError as exc:
                self.err(f"crush-trio run: {exc}")
                return EXIT_FAILED
        if self.interrupted:
            self.err("crush-trio run: interrupted")
            return EXIT_INTERRUPTED
        self.err(f"crush-trio run: no answer within --timeout {opts.timeout:g} s")
        return EXIT_FAILED

    def _client(self) -> AbstractAsyncContextManager[Client]:
        opts = self.options
        return open_client(opts.server, opts.token, verbose=opts.verbose)

    async def _pick_session(self, ws: WorkspaceClient) -> tuple[Session, bool]:
        """The session to send to, and whether this command created it."""
        opts = self.options
        if opts.session is not None:
            try:
                return await ws.resolve_session(opts.session), False
            except (NotFound, BadRequest) as exc:
                raise UsageError(str(exc)) from None
        if opts.continue_last:
            latest = await ws.latest_session()
            if latest is not None:
                return latest, False
        return await ws.create_session(), True

    async def _in_workspace(self, ws: WorkspaceClient, deadline: float) -> int:
        opts = self.options
        session, created = await self._pick_session(ws)
        self.err(f"session: {session.id}")
        self.sending = True
        try:
            handle = await ws.prompt(
                session.id,
                opts.prompt,
                str(uuid.uuid4()),
                auto_approve=opts.yolo,
                model=opts.model,
                attachments=opts.attachments,
            )
        except BadRequest as exc:
            if created:  # refused before any run: leave no empty session behind
                with trio.move_on_after(RECORD_TIMEOUT):
                    await ws.delete_session(session.id)
            if opts.model is not None and str(exc).startswith("model:"):
                detail = str(exc).removeprefix("model:").strip()
                detail = detail.removeprefix(f"model {opts.model!r} ")
                raise UsageError(f"--model {opts.model} {detail}") from None
            raise
        finally:
            self.sending = False
        self.handle = handle
        assert self.outer is not None
        self.outer.deadline = math.inf  # from here the waiting scope carries the deadline
        own_error: AgentEvent | None = None
        with trio.CancelScope(deadline=deadline) as waiting:
            self.waiting = waiting
            if self.interrupted:
                waiting.cancel()
            own_error = await self._follow(handle)
        self.waiting = None
        if waiting.cancelled_caught and not handle.done:
            # Interrupted or out of time: cancel our run and wait briefly for its terminal.
            with trio.move_on_after(CANCEL_WAIT):
                try:
                    await handle.cancel()
                    await handle.wait(CANCEL_WAIT)
                except CrushError as exc:
                    self.err(f"crush-trio run: could not cancel run {handle.run_id}: {exc}")
        await self._finish_output(handle)
        if opts.diff:
            await self._print_diff(ws, handle)
        if waiting.cancelled_caught:
            if self.interrupted:
                self.err("crush-trio run: interrupted; the run was cancelled")
                return EXIT_INTERRUPTED
            self.err(f"crush-trio run: no result within --timeout {opts.timeout:g} s; cancelled it")
            return EXIT_FAILED
        complete = handle.complete
        if complete is not None and complete.error and not complete.cancelled:
            self.err(f"agent run failed: {complete.error}")
            return EXIT_FAILED
        if own_error is not None:
            self.err(f"agent run failed: {own_error.text or own_error.error}")
            return EXIT_FAILED
        return EXIT_OK

    async def _follow(self, handle: RunHandle) -> AgentEvent | None:
        """Print the run's events until its end; returns its first error event, if any.

        After an error event of the run, its ``run_complete`` is awaited at most
        :data:`ERROR_GRACE` seconds.
        """
        own_error: AgentEvent | None = None
        json_mode = self.options.format == "json"
        with trio.CancelScope() as grace:
            async for event in handle.events(timeout=None):
                message = event.message  # a snapshot, or the message a delta leads to
                if json_mode:
                    self.json_line(event.to_json())
                    if message is not None:
                        self.first_output.set()
                elif message is not None:
                    self.out(self.transcript.update(message))
                if _is_error(event) and own_error is None:
                    assert isinstance(event.payload, AgentEvent)
                    own_error = event.payload
                    grace.deadline = trio.current_time() + ERROR_GRACE
        return own_error

    async def _finish_output(self, handle: RunHandle) -> None:
        """Text: the rest of the reply and the final newline. JSON: the final run record."""
        complete: RunComplete | None = handle.complete
        if self.options.format == "json":
            record: Any
            if handle.done:
                try:
                    record = await handle.result(RECORD_TIMEOUT, check=False)
                except CrushError:
                    record = None
            else:
                try:
                    record = await handle.workspace.get_run(handle.run_id)
                except CrushError:
                    record = None
            if record is not None:
                self.json_line(wire.converter.unstructure(record))
            return
        if complete is not None:
            self.out(self.transcript.finish(complete.message_id, complete.text))
        self._clear_spinner()
        if self.first_output_written:  # a run that printed nothing (failed early) ends no line
            self.stdout.write("\n")
            self.stdout.flush()

    async def _print_diff(self, ws: WorkspaceClient, handle: RunHandle) -> None:
        """``--diff``: the files the run changed (stderr) and its unified diff (stdout); in JSON
        mode one ``{"type": "diff", ...}`` line."""
        try:
            with trio.fail_after(RECORD_TIMEOUT):
                diff = await ws.run_diff(handle.run_id)
        except (CrushError, trio.TooSlowError) as exc:
            self.err(f"crush-trio run: no diff for run {handle.run_id}: {exc}")
            return
        if self.options.format == "json":
            self.json_line({"type": "diff", **wire.converter.unstructure(diff)})
            return
        if not diff.files:
            self.err("files changed: none")
            return
        self.err(f"files changed: {len(diff.files)}")
        for f in diff.files:
            counts = "binary" if f.binary else f"+{f.added} -{f.removed}"
            self.err(f"  {f.status:<8} {f.path} ({counts})")
        self.stdout.write(diff.diff)
        if diff.truncated:
            self.err(
                "crush-trio run: the diff was cut at the server's bound (see docs/protocol.md)"
            )
        self.stdout.flush()


def _is_error(event: Event) -> bool:
    return event.type == "agent_event" and getattr(event.payload, "type", "") == "error"
