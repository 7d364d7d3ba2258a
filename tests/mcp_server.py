"""A small MCP server for the tests, written with the official SDK (stdio transport).

Usage: ``python mcp_server.py MODE [PID_FILE]``

* ``serve``: tools ``add``, ``picture`` (an image), ``fail`` (an error) and ``die`` (answers,
  then the process exits);
* ``exit``: writes a reason to stderr and exits with status 3 before speaking MCP;
* ``hang``: never answers (sleeps);
* ``http PORT``: the ``serve`` tools over streamable HTTP on ``127.0.0.1:PORT`` (path ``/mcp``).

With ``PID_FILE`` the process writes its pid there first, so a test can check it is gone.
"""

import os
import signal
import sys
import threading


def main() -> None:
    mode = sys.argv[1]
    if len(sys.argv) > 2 and mode != "http":
        with open(sys.argv[2], "w") as f:
            f.write(str(os.getpid()))
    if mode == "exit":
        print("mcp_server: bad configuration, giving up", file=sys.stderr)
        sys.exit(3)
    if mode == "hang":
        while True:
            signal.pause()  # never answers; the server's start timeout must end it

    from mcp.server.mcpserver import Context, Image, MCPServer

    app = MCPServer("crush-trio-test")

    @app.tool()
    def add(a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)

    @app.tool()
    def picture() -> Image:
        """A tiny PNG."""
        return Image(data=b"\x89PNG\r\n\x1a\n" + b"\0" * 30, format="png")

    @app.tool()
    def fail(reason: str) -> str:
        """Always fails with ``reason``."""
        raise ValueError(reason)

    @app.tool()
    async def grow(ctx: Context) -> str:
        """Adds the tool ``extra`` and tells the client its tool list changed."""

        def extra() -> str:
            """A tool added while connected."""
            return "extra"

        app.add_tool(extra)
        await ctx.session.send_tool_list_changed()
        return "grown"

    @app.tool()
    def die() -> str:
        """Answers, then the server process exits."""
        threading.Timer(0.2, lambda: os._exit(4)).start()
        return "exiting"

    if mode == "http":
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run("stdio")


if __name__ == "__main__":
    main()
