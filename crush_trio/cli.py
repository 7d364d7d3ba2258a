"""The ``crush-trio`` command: ``serve`` (PROTOCOL §1), ``run`` (PROTOCOL §8), ``models`` and
``trust``.

argparse (stdlib) is enough for these flat flag sets and keeps start-up fast for ``run``.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from . import __version__
from .errors import ConfigError, CrushError, unwrap_group

if TYPE_CHECKING:
    from .server.serve import ServeOptions, ServerHandle

#: Defaults of ``serve`` (repeated here so ``crush-trio run`` need not import the server).
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7433

EXIT_USAGE = 2


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the server", description="Run the crush_trio server.")
    p.add_argument("--host", default=DEFAULT_HOST, help="address, or unix:/path/to.sock")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port (0 picks a free one)")
    p.add_argument("--data-dir", type=Path, default=None, help="where workspace databases live")
    p.add_argument(
        "--config", type=Path, default=None, help="crush.json to use for every workspace"
    )
    token = p.add_mutually_exclusive_group()
    token.add_argument(
        "--token", default=None, help="auth token (default: a random one is printed)"
    )
    token.add_argument(
        "--token-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="read the auth token from this file (keeps it out of the process list)",
    )
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="another origin allowed to open event streams and send requests (repeatable)",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="another host name the server answers to, besides loopback ones (repeatable)",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="text lines, or one JSON object per line (docs/operations.md)",
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
    parser = argparse.ArgumentParser(prog="crush-trio", description=__doc__)
    parser.add_argument("--version", action="version", version=f"crush-trio {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _trust_parser(sub)
    try:
        from .run_cmd import add_run_parser
    except ImportError:  # pragma: no cover - the run command is optional during development
        pass
    else:
        add_run_parser(sub)
        from .models_cmd import add_models_parser

        add_models_parser(sub)
    return parser


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
                print(f"crush-trio: cannot listen on {args.host}: {exc}", file=sys.stderr)
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
