"""What a web page, a rebinding DNS name or a careless log can do to the server (PROTOCOL §2).

Each test pins one rule of docs/protocol.md "Host, origin and content type" or a fix of the same
hardening: the per-port token cookie, cross-site and content-type checks of state-changing
requests, the ``Host`` allow-list on every path, the page's security headers, token redaction
after URL-decoding, ``--token-file``, the data directory's mode and ``.gitignore``, workspace
paths that used to crash the route, and ``shutdown_if_idle`` with Crush's meaning.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from crush_trio.cli import main as cli_main
from crush_trio.server.security import HOST_CACHE_SIZE, HostPolicy, redact_target
from crush_trio.store.datadir import ensure_data_dir

from .conftest import TOKEN, WAIT, Server, running_server

UPGRADE = {
    "Connection": "Upgrade",
    "Upgrade": "websocket",
    "Sec-WebSocket-Version": "13",
    "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
}


def port_of(server: Server) -> str:
    return server.url.rsplit(":", 1)[1]


def write_user_config(tmp_path: Path, server_section: dict[str, Any]) -> None:
    folder = tmp_path / "user-config"
    folder.mkdir(exist_ok=True)
    (folder / "crush.json").write_bytes(orjson.dumps({"server": server_section}))


# -- 1. the token cookie is per port ----------------------------------------------------------


async def test_token_cookie_is_named_after_the_port(server: Server) -> None:
    port = port_of(server)
    async with httpx.AsyncClient(base_url=server.url) as browser:
        r = await browser.get("/", params={"token": TOKEN})
        assert r.status_code == 303
        prefix = r.headers["location"].removesuffix("/")
        cookie = r.headers["set-cookie"]
        assert cookie.startswith(f"crush_trio_token_{port}={TOKEN};")
        for attribute in ("HttpOnly", f"Path={prefix}", "SameSite=Strict"):
            assert attribute in cookie
        assert (await browser.get(f"{prefix}/v1/workspaces")).status_code == 200
    # Another port's cookie (what a server on another port set) does not authenticate here, and
    # neither does the old port-less name.
    for name in (f"crush_trio_token_{int(port) + 1}", "crush_trio_token"):
        async with httpx.AsyncClient(base_url=server.url, cookies={name: TOKEN}) as other:
            r = await other.get("/v1/workspaces")
            assert r.status_code == 401, name


async def test_token_cookie_is_not_sent_to_other_ports_of_the_host(
    server: Server, tmp_path: Path
) -> None:
    """Cookies ignore ports: a cookie for ``Path=/`` would reach a dev server the agent started
    on another port of localhost. It is scoped to a path prefix that is new at every start and
    under which the page, its files, the API and the websocket are served."""
    port = int(port_of(server))
    async with httpx.AsyncClient(base_url=server.url) as browser:
        r = await browser.get("/", params={"token": TOKEN, "x": "1"})
        assert r.status_code == 303
        location = r.headers["location"]
        prefix, _, query = location.partition("/?")
        assert query == "x=1"
        assert re.fullmatch(r"/w-[0-9a-f]{32}", prefix), location
        # What the browser's cookie jar sends where: the token goes below the prefix of this
        # server only, never to the root of this or another port.
        for url, sent in [
            (f"http://127.0.0.1:{port}{prefix}/v1/workspaces", True),
            (f"http://127.0.0.1:{port}/v1/workspaces", False),
            (f"http://127.0.0.1:{port + 1}/", False),
            (f"http://127.0.0.1:{port + 1}/api/login", False),
        ]:
            request = browser.build_request("GET", url)
            assert (TOKEN in request.headers.get("cookie", "")) is sent, url
        # The page and its files are served below the prefix, with the cookie alone.
        page = await browser.get(f"{prefix}/")
        assert page.status_code == 200
        assert 'src="static/app.js"' in page.text
        assert (await browser.get(f"{prefix}/static/app.js")).status_code == 200
        assert (await browser.get("/v1/workspaces")).status_code == 401
    # A new start has a new prefix.
    (tmp_path / "again").mkdir()
    async with (
        running_server(tmp_path / "again") as again,
        httpx.AsyncClient(base_url=again.url) as other,
    ):
        r = await other.get("/", params={"token": TOKEN})
        assert not r.headers["location"].startswith(prefix)


# -- 2. state-changing requests: Origin, Sec-Fetch-Site, Content-Type -------------------------


async def test_cross_site_post_is_refused_and_does_not_act(server: Server) -> None:
    cases: list[tuple[dict[str, str], int, str]] = [
        ({"Origin": "http://127.0.0.1:1"}, 403, "origin"),
        ({"Origin": "null"}, 403, "origin"),
        ({"Sec-Fetch-Site": "cross-site"}, 403, "cross-site"),
        ({"Sec-Fetch-Site": "same-site"}, 403, "same-site"),
        ({"Content-Type": "text/plain"}, 415, "application/json"),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "application/json"),
    ]
    body = orjson.dumps({"command": "shutdown"})
    for extra, status, words in cases:
        headers = {"Content-Type": "application/json", **extra}
        r = await server.http.post("/v1/control", content=body, headers=headers)
        assert r.status_code == status, (extra, r.text)
        assert words in r.json()["message"], (extra, r.json())
    # A body without any content type is refused too (a browser's "simple" request).
    r = await server.http.post("/v1/control", content=body)
    assert r.status_code == 415
    assert "Content-Type" in r.json()["message"]
    assert not server.backend.shutting_down
    r = await server.http.get("/v1/health")
    assert r.status_code == 200


async def test_same_origin_and_bodiless_requests_pass(server: Server) -> None:
    ws = await server.open_workspace()
    own = server.url
    headers = {
        "Origin": own,
        "Sec-Fetch-Site": "same-origin",
        "Content-Type": "application/json; charset=utf-8",
    }
    r = await server.http.post(
        f"/v1/workspaces/{ws['id']}/sessions", content=b'{"title": "t"}', headers=headers
    )
    assert r.status_code == 200, r.text
    # No body and no content type: allowed (cancel, clear, DELETE, a session with defaults).
    r = await server.http.post(f"/v1/workspaces/{ws['id']}/sessions")
    assert r.status_code == 200, r.text
    sid = r.json()["id"]
    r = await server.http.delete(f"/v1/workspaces/{ws['id']}/sessions/{sid}")
    assert r.status_code == 200, r.text


async def test_allowed_origin_may_send_requests(tmp_path: Path) -> None:
    async with running_server(tmp_path, allow_origins=["http://localhost:5173"]) as server:
        ws = await server.open_workspace()
        r = await server.http.post(
            f"/v1/workspaces/{ws['id']}/sessions",
            json={},
            headers={"Origin": "http://localhost:5173", "Sec-Fetch-Site": "same-site"},
        )
        assert r.status_code == 200, r.text


# -- 3. the Host allow-list -------------------------------------------------------------------


async def test_foreign_host_is_misdirected_even_without_a_token(tmp_path: Path) -> None:
    async with running_server(tmp_path, token="") as server:
        del server.http.headers["Authorization"]
        ws = await server.open_workspace()
        port = port_of(server)
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as page:
            for path in ("/v1/workspaces", "/v1/health", "/", f"/v1/workspaces/{ws['id']}"):
                r = await page.get(path, headers={"Host": f"rebound.example:{port}"})
                assert r.status_code == 421, (path, r.text)
                assert "server.allowed_hosts" in r.json()["message"]
            r = await page.post(
                "/v1/control",
                json={"command": "shutdown"},
                headers={"Host": f"rebound.example:{port}"},
            )
            assert r.status_code == 421
            assert not server.backend.shutting_down
            for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LocalHost"):
                r = await page.get("/v1/workspaces", headers={"Host": host})
                assert r.status_code == 200, (host, r.text)


@pytest.mark.parametrize("transport", ["trio-websocket", "asgi"])
async def test_foreign_host_is_refused_on_event_streams(tmp_path: Path, transport: str) -> None:
    write_user_config(tmp_path, {"ws_transport": transport})
    async with running_server(tmp_path) as server:
        ws = await server.open_workspace()
        port = port_of(server)
        cid = str(uuid.uuid4())
        bad = {"Host": f"rebound.example:{port}", "Authorization": f"Bearer {TOKEN}"}
        for route, extra in (("ws", UPGRADE), ("events", {})):
            # One connection per request: a refused upgrade ends its connection.
            async with httpx.AsyncClient(base_url=server.url, timeout=5) as page:
                r = await page.get(
                    f"/v1/workspaces/{ws['id']}/{route}",
                    params={"client_id": cid},
                    headers=bad | extra,
                )
            assert r.status_code == 421, (route, r.text)
            assert "server.allowed_hosts" in r.json()["message"]


async def test_configured_and_flagged_hosts_are_served(tmp_path: Path) -> None:
    write_user_config(tmp_path, {"allowed_hosts": ["box.lan"]})
    async with running_server(tmp_path, allow_hosts=["dev.local"]) as server:
        port = port_of(server)
        for host in (f"box.lan:{port}", "dev.local", f"DEV.LOCAL:{port}"):
            r = await server.http.get("/v1/workspaces", headers={"Host": host})
            assert r.status_code == 200, (host, r.text)
        r = await server.http.get("/v1/workspaces", headers={"Host": "box.lan.evil.example"})
        assert r.status_code == 421


def test_host_policy_bind_address_and_cache() -> None:
    policy = HostPolicy(["Box.Lan:8080"], bind="192.168.1.5")
    assert policy.allows("box.lan")
    assert policy.allows("192.168.1.5:7433")
    assert policy.allows("127.0.0.2:1")  # any loopback address
    assert not policy.allows("192.168.1.6:7433")
    assert not policy.allows("localhost:port")
    assert not policy.allows("[::1]junk")
    wildcard = HostPolicy(bind="0.0.0.0")
    assert wildcard.allows("10.0.0.7:7433")
    assert wildcard.allows("[fe80::1]:7433")
    assert not wildcard.allows("attacker.example:7433")
    for n in range(3 * HOST_CACHE_SIZE):
        assert not policy.allows(f"h{n}.example")
    assert len(policy._cache) <= HOST_CACHE_SIZE


# -- 4. page headers --------------------------------------------------------------------------


async def test_page_forbids_framing_and_foreign_connections(server: Server) -> None:
    port = port_of(server)
    for path in ("/", "/static/app.js"):
        r = await server.http.get(path)
        assert r.status_code == 200, path
        csp = r.headers["content-security-policy"]
        directives = {}
        for part in csp.split(";"):
            name, _, value = part.strip().partition(" ")
            directives[name] = value
        assert directives["frame-ancestors"] == "'none'"
        sources = directives["connect-src"].split()
        assert sources[0] == "'self'"
        assert all(s.endswith(f"//127.0.0.1:{port}") for s in sources[1:]), sources
        assert r.headers["x-frame-options"] == "DENY"
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["referrer-policy"] == "no-referrer"


# -- 5. redaction after URL-decoding ----------------------------------------------------------


async def test_access_log_redacts_encoded_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="crush_trio.access")
    async with running_server(tmp_path, access_log=True) as server:
        async with httpx.AsyncClient(base_url=server.url) as anon:
            for query in ("%74oken=" + TOKEN, "TOKEN=" + TOKEN, "x=1&%74%6Fken=" + TOKEN):
                await anon.get(f"/v1/workspaces?{query}")
            r = await anon.get("/v1/workspaces?%74oken=" + TOKEN)
            assert r.status_code == 200  # it does authenticate
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "crush_trio.access"]
    assert len(lines) >= 4
    assert not [line for line in lines if TOKEN in line]
    assert any("token=%5Bredacted%5D" in line or "[redacted]" in line for line in lines)


def test_redact_target_catches_every_spelling() -> None:
    secret = "s3cr/t+x"
    for query in (
        "token=s3cr%2Ft%2Bx",
        "%74oken=abc",
        "%54OKEN=abc",
        "other=s3cr%2Ft%2Bx",
        "a=1&token=",
    ):
        text = redact_target("/v1/x", query.encode(), secret)
        assert "abc" not in text, (query, text)
        assert "s3cr" not in text, (query, text)


# -- 6. --token-file --------------------------------------------------------------------------


def test_token_file_errors_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path, words in ((tmp_path / "missing", "cannot read"), (empty, "is empty")):
        assert cli_main(["serve", "--token-file", str(path)]) == 2
        err = capsys.readouterr().err
        assert words in err
        assert str(path) in err
    with pytest.raises(SystemExit):  # --token and --token-file exclude each other
        cli_main(["serve", "--token", "a", "--token-file", str(empty)])


def test_token_file_keeps_the_token_out_of_the_process_list(tmp_path: Path) -> None:
    secret = "tok-" + uuid.uuid4().hex
    token_file = tmp_path / "token"
    token_file.write_text(secret + "\n")
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "crush_trio", "serve", "--port", "0", "--no-access-log"),
            *("--data-dir", str(tmp_path / "data"), "--token-file", str(token_file)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg")},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        match = re.fullmatch(r"crush-trio listening on (http://\S+)/\?token=(\S+)", line)
        assert match, line
        assert match.group(2) == secret, line
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert secret.encode() not in cmdline
        r = httpx.get(match.group(1) + "/v1/workspaces", headers={"Authorization": "Bearer x"})
        assert r.status_code == 401
        r = httpx.get(
            match.group(1) + "/v1/workspaces", headers={"Authorization": f"Bearer {secret}"}
        )
        assert r.status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=WAIT)
        if proc.stdout is not None:
            proc.stdout.close()


# -- 7. the data directory --------------------------------------------------------------------


async def test_data_directory_is_private_and_git_ignored(server: Server) -> None:
    ws = await server.open_workspace()
    data_dir = Path(ws["data_dir"])
    for directory in (data_dir, data_dir.parent):  # the workspace's and the --data-dir root
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    assert (data_dir / ".gitignore").read_text() == "*\n"


def test_ensure_data_dir_keeps_an_existing_mode_and_gitignore(tmp_path: Path) -> None:
    existing = tmp_path / "mine"
    existing.mkdir(mode=0o755)
    os.chmod(existing, 0o755)
    (existing / ".gitignore").write_text("custom\n")
    ensure_data_dir(existing)
    assert stat.S_IMODE(existing.stat().st_mode) == 0o755
    assert (existing / ".gitignore").read_text() == "custom\n"
    fresh = tmp_path / "a" / "b"
    old = os.umask(0o077 | 0o700)  # even a umask that strips the owner's bits
    try:
        ensure_data_dir(fresh)
    finally:
        os.umask(old)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    assert stat.S_IMODE(fresh.parent.stat().st_mode) == 0o700


# -- 8. workspace paths that crashed the route ------------------------------------------------


async def test_unusable_workspace_paths_are_400(server: Server) -> None:
    cases = [
        (str(server.tmp) + "/a\x00b", "NUL"),
        ("~nosuchuser-" + uuid.uuid4().hex[:8], "not absolute"),
        ("~", "not absolute"),
        ("~/", "not absolute"),
    ]
    for path, words in cases:
        r = await server.http.post(
            "/v1/workspaces", json={"path": path, "client_id": str(uuid.uuid4())}
        )
        assert r.status_code == 400, (path, r.text)
        assert words in r.json()["message"], (path, r.json())
    assert server.backend.list() == []


# -- 9. shutdown_if_idle means no open workspace ----------------------------------------------


async def test_shutdown_if_idle_refuses_while_a_workspace_is_open(server: Server) -> None:
    cid = str(uuid.uuid4())
    ws = await server.open_workspace(client_id=cid)
    r = await server.http.post("/v1/control", json={"command": "shutdown_if_idle"})
    assert r.status_code == 409
    assert "not idle" in r.json()["message"]
    assert not server.backend.shutting_down
    # A create in progress counts too.
    pending = server.tmp / "pending"
    server.backend._opening[pending] = trio.Event()
    try:
        r = await server.http.post("/v1/control", json={"command": "shutdown_if_idle"})
        assert r.status_code == 409
    finally:
        del server.backend._opening[pending]
    workspace = server.backend.get(ws["id"])
    r = await server.http.delete(f"/v1/workspaces/{ws['id']}", params={"client_id": cid})
    assert r.status_code == 200
    with trio.fail_after(WAIT):
        await workspace.closed.wait()
    r = await server.http.post("/v1/control", json={"command": "shutdown_if_idle"})
    assert r.status_code == 200
    with trio.fail_after(WAIT):
        await server.backend.stopped.wait()
