"""The ``crush-trio`` command line: ``serve``, ``run``, ``sessions``, ``models`` and ``trust``.

The help texts are the user's manual (docs/cli.md says the same at length). argparse is kept over
click or typer: the flag sets are flat, it costs nothing at start-up (``run`` is often called from
scripts), and the two things it lacked, defaults in ``--help`` and a hint for a mistyped flag, are
a formatter class and :func:`_unknown_flag_hint` here.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from . import __version__
from .defaults import DEFAULT_HOST, DEFAULT_PORT
from .errors import ConfigError, CrushError, unwrap_group

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .server.serve import ServeOptions, ServerHandle

EXIT_USAGE = 2

#: What ``crush-trio --help`` says above the list of commands.
OVERVIEW = """\
A headless server for AI coding-agent sessions, and its command-line client.

  crush-trio serve                     run the server (http://127.0.0.1:7433 by default);
                                       open the URL it prints in a browser
  crush-trio run "explain main.py"     send one prompt and print the reply (starts an
                                       embedded server when --server is not given)
  crush-trio sessions                  list this directory's sessions (to continue one: run -s ID)
  crush-trio trust [DIR]               let DIR's own crush.json apply in full

With no configuration the built-in offline `echo` model answers; configure a provider in
~/.config/crush-trio/crush.json (docs/providers.md).
"""

#: What ``crush-trio --help`` says below the list of commands.
EPILOG = """\
environment:
  CRUSH_TRIO_SERVER, CRUSH_TRIO_TOKEN   the server and token for run and sessions
  XDG_CONFIG_HOME                       where the user's crush-trio/crush.json is looked up

`crush-trio COMMAND --help` describes each command; docs/cli.md has the details.
"""


def _unknown_flag_hint(parser: argparse.ArgumentParser, flag: str) -> str:
    """A hint for an unknown ``flag`` of ``parser``: a known spelling, or the closest flag."""
    import difflib

    known = {
        "--json": "--format json",
        "--text": "--format text",
        "--model": "-m PROVIDER/MODEL",
        "--verbose": "--log-level DEBUG",
        "--continue-last": "-C",
    }
    name = flag.split("=", 1)[0]
    options = sorted(set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", parser.format_help())))
    if name in known and name not in options:
        return f"did you mean {known[name]}?"
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    return f"did you mean {close[0]}?" if close else ""


#: Each command's parser, by name (filled by :func:`build_parser`), to report a bad flag.
_COMMANDS: dict[str, argparse.ArgumentParser] = {}


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``serve`` command and its flags, in the order ``--help`` lists them."""
    p = sub.add_parser(
        "serve",
        help="run the server",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run the server. It prints `crush-trio listening on URL?token=TOKEN`: open that URL\n"
            "in a browser (the token becomes a cookie), or send the token as\n"
            "`Authorization: Bearer TOKEN` from scripts. Ctrl-C (or SIGTERM) stops it gracefully:\n"
            "runs are cancelled and their outcome saved."
        ),
    )
    p.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address, or unix:/path/to.sock (default: {DEFAULT_HOST})",
    )
    p.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"TCP port; 0 picks a free one (default: {DEFAULT_PORT})",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where workspace databases live (default: each workspace's .crush/)",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="crush.json to use for every workspace (default: the workspace's own over the user's)",
    )
    token = p.add_mutually_exclusive_group()
    token.add_argument(
        "--token",
        default=None,
        help="auth token (default: a random one, printed in the listening line)",
    )
    token.add_argument(
        "--token-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="read the auth token from this file (keeps it out of the process list)",
    )
    _add_serve_access_flags(p)
    _add_serve_log_flags(p)
    _add_serve_cluster_flags(p)


def _add_serve_access_flags(p: argparse.ArgumentParser) -> None:
    """``serve``'s flags for who may talk to the server besides its own page."""
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="another origin allowed to open event streams and send requests (repeatable; "
        "default: the server's own)",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="another host name the server answers to, besides loopback ones (repeatable; "
        "default: none)",
    )


def _add_serve_log_flags(p: argparse.ArgumentParser) -> None:
    """``serve``'s flags for logs and metrics."""
    p.add_argument(
        "--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: INFO)"
    )
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="text lines, or one JSON object per line, docs/operations.md (default: text)",
    )
    p.add_argument("--no-access-log", action="store_true", help="do not log each request")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="also serve /metrics without the token on 127.0.0.1:PORT (0: any free port; "
        "default: server.metrics_port, else off)",
    )


def _add_serve_cluster_flags(p: argparse.ArgumentParser) -> None:
    """``serve``'s flags of cluster mode (each overrides the config's ``cluster`` section)."""
    cluster = p.add_argument_group(
        "cluster",
        "run as one node of a cluster (docs/cluster.md); each flag overrides the "
        "config's cluster section",
    )
    cluster.add_argument(
        "--cluster-database-url",
        default=None,
        metavar="DSN",
        help="PostgreSQL DSN shared by the nodes (turns cluster mode on)",
    )
    cluster.add_argument(
        "--cluster-redis-url", default=None, metavar="URL", help="Redis URL for the event logs"
    )
    cluster.add_argument(
        "--cluster-node-id", default=None, metavar="ID", help="this node's unique id"
    )
    cluster.add_argument(
        "--cluster-advertise-url",
        default=None,
        metavar="URL",
        help="the URL other nodes send clients to (default: the listening URL)",
    )
    cluster.add_argument(
        "--cluster-lease-ttl",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds a workspace lease lasts unrenewed (cluster.lease_ttl)",
    )


def _trust_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "trust",
        help="trust a workspace's own crush.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Add a workspace directory to trusted_workspaces in the user's crush.json, so its "
            "own crush.json and .crush.json apply in full (providers, environment variables, "
            "pre-approved tools, data directory). Untrusted workspaces may only choose models "
            "and tune harmless options. A running server applies the change to an open "
            "workspace when it is next opened."
        ),
    )
    p.add_argument("path", type=Path, nargs="?", default=None, help="workspace (default: .)")
    p.add_argument(
        "--untrust", action="store_true", help="remove the workspace from trusted_workspaces"
    )


def _trust_main(args: argparse.Namespace) -> int:
    from .config import set_workspace_trust

    path: Path = args.path if args.path is not None else Path.cwd()
    try:
        change = set_workspace_trust(path, not args.untrust)
    except ConfigError as bad:
        print(f"crush-trio: {bad}", file=sys.stderr)
        return EXIT_USAGE
    real = path.expanduser().resolve()
    state = "trusted" if change.trusted else "not trusted"
    note = "" if change.changed else " (no change)"
    print(f"{real}: {state}{note}; {change.file}")
    if change.still_trusted_by:
        print(
            "crush-trio: still trusted through "
            + ", ".join(change.still_trusted_by)
            + f"; remove that entry from {change.file} to untrust it",
            file=sys.stderr,
        )
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crush-trio",
        description=OVERVIEW,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"crush-trio {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _serve_parser(sub)
    from .run_cmd import add_run_parser, add_sessions_parser

    add_run_parser(sub)
    add_sessions_parser(sub)
    _trust_parser(sub)
    from .models_cmd import add_models_parser

    add_models_parser(sub)
    _COMMANDS.update(sub.choices)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; an unknown flag is reported by its command, with a hint when one fits."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = getattr(args, "command", None)
        owner = _COMMANDS.get(command, parser) if command else parser
        unknown = next((word for word in extra if word.startswith("-")), extra[0])
        hint = _unknown_flag_hint(owner, unknown) if unknown.startswith("-") else ""
        what = "unknown flag" if unknown.startswith("-") else "unexpected argument"
        owner.error(f"{what} {unknown}" + (f"; {hint}" if hint else ""))
    return args


async def _serve_main(options: ServeOptions) -> None:
    from .server.serve import serve

    async with trio.open_nursery() as nursery:

        async def run_server(*, task_status: trio.TaskStatus[ServerHandle]) -> None:
            await serve(options, task_status=task_status)
            nursery.cancel_scope.cancel()  # stop the signal watcher too

        handle: ServerHandle = await nursery.start(run_server)
        print(handle.listening_line, flush=True)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                handle.stop()
                break


def read_token_file(path: Path) -> str:
    """The token in ``path`` (surrounding whitespace stripped).

    Raises:
        ConfigError: the file cannot be read, is empty, or holds more than one line.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(
            f"--token-file {path}: cannot read it ({reason}); give a readable file that holds "
            "the token"
        ) from None
    token = text.strip()
    if not token:
        raise ConfigError(
            f"--token-file {path} is empty; write the token into it (to disable authentication "
            "on a loopback host, use --token '' instead)"
        )
    if any(c.isspace() for c in token):
        raise ConfigError(
            f"--token-file {path} holds whitespace inside the token; the file must hold one "
            "token on one line"
        )
    return token


def _listen_error(host: str, port: int, exc: OSError) -> str:
    """Why ``serve`` could not listen on ``host``:``port``, and what to do about it."""
    import errno

    where = host if host.startswith("unix:") else f"{host}:{port}"
    reason = exc.strerror or str(exc)
    if exc.errno == errno.EADDRINUSE:
        if host.startswith("unix:"):
            return (
                f"cannot listen on {where}: {reason}; remove the socket file or pick another path"
            )
        return (
            f"cannot listen on {where}: {reason} (another server is on port {port}?); "
            "stop it, or choose another port with --port (0 picks a free one)"
        )
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"cannot listen on {where}: {reason}; use a port above 1023 with --port"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {where}: {reason}; --host must be an address of this machine"
    return f"cannot listen on {where}: {reason}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = _parse(parser, argv)
    if args.command == "trust":
        return _trust_main(args)
    if args.command == "serve":
        from .logs import configure_logging
        from .server.serve import ServeOptions

        configure_logging(args.log_level, args.log_format, sys.stderr)
        token = args.token
        if args.token_file is not None:
            try:
                token = read_token_file(args.token_file)
            except ConfigError as bad:
                print(f"crush-trio: {bad}", file=sys.stderr)
                return EXIT_USAGE
        options = ServeOptions(
            host=args.host,
            port=args.port,
            data_dir=args.data_dir,
            config_file=args.config,
            token=token,
            token_file=args.token_file,
            allow_origins=args.allow_origin,
            allow_hosts=args.allow_host,
            access_log=not args.no_access_log,
            metrics_port=args.metrics_port,
            cluster={
                key: value
                for key, value in (
                    ("database_url", args.cluster_database_url),
                    ("redis_url", args.cluster_redis_url),
                    ("node_id", args.cluster_node_id),
                    ("advertise_url", args.cluster_advertise_url),
                    ("lease_ttl", args.cluster_lease_ttl),
                )
                if value is not None
            },
        )
        try:
            trio.run(_serve_main, options)
        except BaseException as group:
            exc = unwrap_group(group)
            if isinstance(exc, ConfigError):
                print(f"crush-trio: {exc}", file=sys.stderr)
                return EXIT_USAGE
            if isinstance(exc, OSError):
                print(f"crush-trio: {_listen_error(args.host, args.port, exc)}", file=sys.stderr)
                return 1
            if isinstance(exc, CrushError):  # e.g. the cluster's database or Redis unreachable
                print(f"crush-trio: {exc}", file=sys.stderr)
                return 1
            raise
        return 0
    run = getattr(args, "run", None)
    if run is not None:
        return int(run(args))
    parser.print_help()
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
