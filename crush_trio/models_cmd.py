"""``crush-trio models``: the providers and models a workspace can use, for ``run -m``.

It asks ``GET /v1/workspaces/{id}/providers`` of ``--server`` (or ``CRUSH_TRIO_SERVER``), or of an
embedded server started for the one call, as ``crush-trio run`` does; ``docs/cli.md`` has the
user's view. Text output is one line per model, ``provider/model`` first (what ``run -m``
takes), with its context window, default output bound and prices, and ``large``/``small``
marking the models those roles use. ``--format json`` prints the providers list as the server
sends it. Keys are never part of the answer.
"""

from __future__ import annotations

import os
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import orjson
import trio

from . import wire
from .client import AuthError, Client, CrushError, Unreachable, connect
from .client import parse_server_url as _parse_server_url
from .run_cmd import ENV_SERVER, ENV_TOKEN, EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE

if TYPE_CHECKING:
    import argparse
    from collections.abc import AsyncIterator, Sequence

    from .wire import CatalogModel, CatalogProvider


def add_models_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``models`` command to the ``crush-trio`` argument parser."""
    p = sub.add_parser(
        "models",
        help="list the providers and models a workspace can use",
        description=(
            "List the providers and models of a workspace's configuration: each model as "
            "provider/model (what run -m takes), its context window, default max tokens and "
            "prices per million tokens; 'large'/'small' mark the models those roles use. "
            "Without --server (or CRUSH_TRIO_SERVER) an embedded server answers. Exit codes: "
            "0 listed, 1 the server refused, 2 usage error, 3 server unreachable."
        ),
    )
    p.add_argument("--server", default=None, help=f"server URL (default: ${ENV_SERVER})")
    p.add_argument("--token", default=None, help=f"server token (default: ${ENV_TOKEN})")
    p.add_argument("--workspace", type=Path, default=None, help="project directory (default: .)")
    p.add_argument("--format", choices=("text", "json"), default="text", help="output format")
    p.set_defaults(run=models_command)


def models_command(args: argparse.Namespace) -> int:
    """The ``models`` command (``args.run`` of the CLI); returns the exit code."""
    env = os.environ
    server = args.server or env.get(ENV_SERVER) or None
    token = args.token if args.token is not None else env.get(ENV_TOKEN)
    if args.token is not None and server is None:
        print(f"crush-trio models: --token needs --server (or {ENV_SERVER})", file=sys.stderr)
        return EXIT_USAGE
    if server is not None:
        try:
            _parse_server_url(server)
        except ValueError as exc:
            print(f"crush-trio models: {exc}", file=sys.stderr)
            return EXIT_USAGE
    workspace = (args.workspace or Path.cwd()).absolute()
    if not workspace.is_dir():
        print(f"crush-trio models: --workspace {workspace} is not a directory", file=sys.stderr)
        return EXIT_USAGE
    return trio.run(
        list_models, server, token if server is not None else None, workspace, args.format
    )


@asynccontextmanager
async def _client(server: str | None, token: str | None) -> AsyncIterator[Client]:
    if server is not None:
        async with connect(server, token) as client:
            yield client
    else:
        from .embedded import embedded
        from .server.serve import ServeOptions

        async with embedded(ServeOptions(access_log=False)) as client:
            yield client


async def list_models(
    server: str | None,
    token: str | None,
    workspace: Path,
    output: str,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Print the workspace's providers and models; returns the exit code."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    try:
        async with (
            _client(server, token) as client,
            client.workspace(workspace, events=False) as ws,
        ):
            providers = await ws.providers()
            chosen = ws.info.config.models if ws.info.config is not None else {}
    except (Unreachable, AuthError) as exc:
        print(f"crush-trio models: {exc}", file=err)
        return EXIT_UNREACHABLE
    except CrushError as exc:
        print(f"crush-trio models: {exc}", file=err)
        return EXIT_FAILED
    if output == "json":
        out.write(orjson.dumps(wire.unstructure(providers)).decode() + "\n")
    else:
        out.write(format_models(providers, chosen))
    out.flush()
    return EXIT_OK


def _price(value: float) -> str:
    return f"${value:g}" if value else "-"


def _model_line(provider: CatalogProvider, model: CatalogModel, roles: Sequence[str]) -> list[str]:
    name = model.name if model.name and model.name != model.id else ""
    return [
        f"{provider.id}/{model.id}",
        name,
        f"context {model.context_window}" if model.context_window else "context -",
        f"max {model.default_max_tokens}" if model.default_max_tokens else "max -",
        f"in {_price(model.cost_per_1m_in)} out {_price(model.cost_per_1m_out)} per 1M",
        " ".join(roles),
    ]


def format_models(providers: list[CatalogProvider], chosen: dict[str, wire.ModelChoice]) -> str:
    """The text output: a header per provider, then one aligned line per model."""
    rows: list[list[str] | str] = []
    for provider in providers:
        where = f" {provider.api_endpoint}" if provider.api_endpoint else ""
        rows.append(f"{provider.id} ({provider.type}){where}")
        if not provider.models:
            rows.append(["  (any model id: the provider lists none)", "", "", "", "", ""])
        for model in provider.models:
            roles = [
                role
                for role in ("large", "small")
                if role in chosen
                and chosen[role].provider == provider.id
                and chosen[role].model == model.id
            ]
            line = _model_line(provider, model, roles)
            line[0] = "  " + line[0]
            rows.append(line)
    cells = [r for r in rows if isinstance(r, list)]
    widths = [max((len(r[i]) for r in cells), default=0) for i in range(6)]
    lines = []
    for row in rows:
        if isinstance(row, str):
            lines.append(row)
        else:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines) + "\n"
