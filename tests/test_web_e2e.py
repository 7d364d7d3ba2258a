"""End-to-end tests of the browser client in real headless Chromium.

The browser is Debian's ``chromium`` (``/usr/bin/chromium``, installed by
``scripts/ensure-browser.sh``) driven by Playwright's sync API. The server runs in its own thread
with its own Trio loop (:class:`ThreadServer`), so the browser side stays plain synchronous code
and a test can give the server a scripted model; the login test starts the real
``python -m crush_trio serve`` and reads the URL it prints.

Every wait in the page is bounded (``WAIT_MS``); nothing sleeps. The slow echo model
(``delay_ms`` per word) makes streaming visible and leaves time to cancel, queue and reconnect.
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx
import pytest
import trio
from playwright.sync_api import Browser, BrowserContext, Page, expect, sync_playwright

from crush_trio.providers.scripted import ScriptedModel, Step
from crush_trio.server.serve import ServeOptions, ServerHandle, serve

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.slow

CHROMIUM: Path = Path("/usr/bin/chromium")
CHROMIUM_ARGS: list[str] = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ROOT: Path = Path(__file__).resolve().parents[1]
ARTIFACTS: Path = ROOT / "test-artifacts"
TOKEN = "web-test-token"
#: Bound on each wait for the page (milliseconds).
WAIT_MS = 8000
#: Bound on starting or stopping a server (seconds).
SERVER_START_TIMEOUT = 15.0
#: Milliseconds the echo model waits between words: slow enough to watch, cancel and reconnect.
ECHO_DELAY_MS = 30
ECHO_CONFIG: dict[str, Any] = {
    "providers": {"echo": {"type": "echo", "delay_ms": ECHO_DELAY_MS}},
    "models": {"large": {"provider": "echo", "model": "echo"}},
}

expect.set_options(timeout=WAIT_MS)


def words(n: int, tag: str) -> str:
    """``n`` distinct words, so a duplicated or missing piece of text is visible."""
    return " ".join(f"{tag}{i}" for i in range(n))


# ---------------------------------------------------------------------------------------------
# The server, in a thread


class ThreadServer:
    """A crush_trio server on 127.0.0.1:0, running ``serve`` in a Trio loop of its own thread."""

    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.handle: ServerHandle
        self._token: trio.lowlevel.TrioToken
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        ready: queue.Queue[Any] = queue.Queue()

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                handle = await nursery.start(partial(serve, self.options))
                ready.put((handle, trio.lowlevel.current_trio_token()))

        def run() -> None:
            try:
                trio.run(main)
            except BaseException as exc:
                ready.put(exc)
                raise

        self._thread = threading.Thread(target=run, name="crush-trio-server", daemon=True)
        self._thread.start()
        item = ready.get(timeout=SERVER_START_TIMEOUT)
        if isinstance(item, BaseException):
            raise item
        self.handle, self._token = item

    def stop(self) -> None:
        if self._thread is None:
            return
        try:
            trio.from_thread.run_sync(self.handle.stop, trio_token=self._token)
        except trio.RunFinishedError:
            pass
        self._thread.join(timeout=SERVER_START_TIMEOUT)
        assert not self._thread.is_alive(), "the server did not stop in time"

    @property
    def url(self) -> str:
        return self.handle.url

    @property
    def login_url(self) -> str:
        return f"{self.handle.url}/?token={self.handle.token}"

    def http(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
        )

    def workspace(self, wid: str) -> Any:
        return self.handle.backend.get(wid)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.skip(
            f"{CHROMIUM} not found: run 'bash scripts/ensure-browser.sh' (installs Debian's "
            "chromium) to run the browser tests"
        )
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


def _start_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: dict[str, Any], **extra: Any
) -> ThreadServer:
    monkeypatch.setenv("CRUSH_TRIO_DEBUG_ROUTES", "1")
    config_file = tmp_path / "crush.json"
    config_file.write_text(json.dumps(config))
    options = ServeOptions(
        host="127.0.0.1",
        port=0,
        data_dir=tmp_path / "data",
        config_file=config_file,
        token=TOKEN,
        user_config_dir=tmp_path / "user-config",
        access_log=False,
        **extra,
    )
    server = ThreadServer(options)
    server.start()
    return server


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ThreadServer]:
    srv = _start_server(tmp_path, monkeypatch, ECHO_CONFIG)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    path = tmp_path / "project"
    path.mkdir()
    return path


class Pages:
    """Opens logged-in pages; fails the test on an uncaught error or a CSP violation in a page."""

    def __init__(self, browser: Browser) -> None:
        self.browser = browser
        self.contexts: list[BrowserContext] = []
        self.errors: list[str] = []

    def open(
        self,
        server: ThreadServer,
        *,
        hash: str = "",
        context: BrowserContext | None = None,
        **context_args: Any,
    ) -> Page:
        if context is None:
            context = self.browser.new_context(
                viewport=context_args.pop("viewport", {"width": 1200, "height": 800}),
                **context_args,
            )
            self.contexts.append(context)
        page = context.new_page()
        page.on("pageerror", lambda exc: self.errors.append(f"{page.url}: {exc}"))
        page.on(
            "console",
            lambda msg: (
                self.errors.append(msg.text) if "Content Security Policy" in msg.text else None
            ),
        )
        page.goto(server.login_url + hash)
        expect(page.locator("h1.brand")).to_have_text("crush_trio")
        return page

    def close(self) -> None:
        for context in self.contexts:
            context.close()


@pytest.fixture
def pages(browser: Browser) -> Iterator[Pages]:
    opened = Pages(browser)
    try:
        yield opened
    finally:
        opened.close()
    assert not opened.errors, f"uncaught errors in the page: {opened.errors}"


def open_workspace(page: Page, path: Path) -> None:
    page.fill("#workspace-path", str(path))
    page.press("#workspace-path", "Enter")
    expect(page.locator("#connection")).to_have_attribute("data-state", "open")
    expect(page.locator("#prompt")).to_be_enabled()


def send(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def assistant_texts(page: Page) -> list[str]:
    return list(page.locator(".message.role-assistant .markdown").all_text_contents())


def wait_for_run(page: Page, status: str, count: int = 1) -> None:
    expect(page.locator(f'#run-list .run[data-status="{status}"]')).to_have_count(count)


def screenshot(page: Page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    target = ARTIFACTS / name
    page.screenshot(path=str(target))
    return target


# ---------------------------------------------------------------------------------------------
# Tests


def test_login_through_the_printed_token_url(browser: Browser, tmp_path: Path) -> None:
    """The URL that ``crush-trio serve`` prints logs the browser in with an HttpOnly cookie."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "crush_trio",
            "serve",
            "--port",
            "0",
            "--no-access-log",
            "--data-dir",
            str(tmp_path / "data"),
            "--token",
            TOKEN,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg")},
    )
    context = None
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        match = re.fullmatch(r"crush-trio listening on (http://\S+)/\?token=(\S+)", line)
        assert match, f"unexpected first line {line!r}"
        base, token = match.groups()
        context = browser.new_context()
        page = context.new_page()
        denied = page.goto(base + "/")
        assert denied is not None
        assert denied.status == 401

        page.goto(f"{base}/?token={token}")
        # The token stays out of the address bar; the page lives below this start's prefix.
        assert re.fullmatch(re.escape(base) + r"/w-[0-9a-f]{32}/", page.url), page.url
        expect(page.locator("#connection")).to_be_visible()
        cookies = {c["name"]: c for c in context.cookies()}
        cookie = cookies["crush_trio_token_" + base.rsplit(":", 1)[1]]  # one cookie per port
        assert cookie["httpOnly"] is True
        assert cookie["sameSite"] == "Strict"
        assert cookie["path"] + "/" == page.url.removeprefix(base)
        assert token not in page.evaluate("document.cookie")
        # Cookies ignore ports: scoped to the prefix, the token is not sent to another server
        # on this host (a dev server the agent started) nor to this one outside the page.
        port = int(base.rsplit(":", 1)[1])
        for url in (f"http://127.0.0.1:{port + 1}/", f"{base}/", f"{base}/v1/workspaces"):
            assert context.cookies(url) == [], url
        # The cookie alone authenticates later requests, the websocket included.
        project = tmp_path / "project"
        project.mkdir()
        open_workspace(page, project)
    finally:
        if context is not None:
            context.close()
        proc.terminate()
        proc.wait(timeout=SERVER_START_TIMEOUT)
        if proc.stdout is not None:
            proc.stdout.close()


def test_prompt_streams_the_reply(server: ThreadServer, pages: Pages, project: Path) -> None:
    page = pages.open(server)
    open_workspace(page, project)
    prompt = "Streaming " + words(40, "w") + " **bold** and `code`"
    send(page, prompt)

    # While it streams: part of the reply is visible and the message is marked busy.
    page.wait_for_function(
        """() => {
            const m = document.querySelector('.message.role-assistant.streaming .markdown');
            return m && m.textContent.length > 0 && m.textContent.includes('w3')
                && !m.textContent.includes('w39');
        }""",
        timeout=WAIT_MS,
    )
    expect(page.locator(".session[data-busy='true']")).to_have_count(1)
    expect(page.locator("#cancel-run")).to_be_enabled()

    wait_for_run(page, "completed")
    expected = prompt.replace("**bold**", "bold").replace("`code`", "code")
    expect(page.locator(".message.role-assistant .markdown")).to_have_text(expected)
    expect(page.locator(".message.role-assistant strong")).to_have_text("bold")
    expect(page.locator(".message.role-assistant .finish")).to_have_attribute(
        "data-reason", "end_turn"
    )
    expect(page.locator(".message.role-user .user-text")).to_have_text(prompt)
    expect(page.locator(".session[data-busy='false']")).to_have_count(1)
    expect(page.locator("#cancel-run")).to_be_disabled()
    assert page.input_value("#prompt") == ""

    # The workspace is remembered, and a reload finds the same session again.
    expect(page.locator("#recent-list .recent-open")).to_have_count(1)
    page.reload()
    expect(page.locator("#connection")).to_have_attribute("data-state", "open")
    expect(page.locator(".message.role-assistant .markdown")).to_have_text(expected)
    expect(page.locator("#recent-list .recent-open")).to_have_attribute("title", str(project))
    screenshot(page, "web-main.png")


PIXEL_PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


def test_attach_a_file_and_paste_an_image(
    server: ThreadServer, pages: Pages, project: Path, tmp_path: Path
) -> None:
    page = pages.open(server)
    open_workspace(page, project)
    notes = tmp_path / "notes.txt"
    notes.write_text("some notes\n")
    page.set_input_files("#attach-input", str(notes))
    expect(page.locator("#attachment-list li")).to_have_count(1)
    # Paste an image into the prompt box.
    page.evaluate(
        """(b64) => {
            const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
            const data = new DataTransfer();
            data.items.add(new File([bytes], "image.png", { type: "image/png" }));
            const box = document.getElementById("prompt");
            box.dispatchEvent(new ClipboardEvent("paste", { clipboardData: data, bubbles: true,
                                                            cancelable: true }));
        }""",
        PIXEL_PNG,
    )
    expect(page.locator("#attachment-list li")).to_have_count(2)
    send(page, "what are these")
    wait_for_run(page, "completed")
    expect(page.locator("#attachment-list")).to_be_hidden()
    user = page.locator(".message.role-user")
    expect(user.locator(".attachment figcaption")).to_have_text(["📎 notes.txt", "📎 pasted-2.png"])
    expect(user.locator(".attachment img")).to_have_count(1)
    with server.http() as http:
        [ws] = http.get("/v1/workspaces").json()
        [session] = http.get(f"/v1/workspaces/{ws['id']}/sessions").json()
        [first, *_] = http.get(
            f"/v1/workspaces/{ws['id']}/sessions/{session['id']}/messages"
        ).json()
    assert [p["data"]["mime_type"] for p in first["parts"] if p["type"] == "binary"] == [
        "text/plain",
        "image/png",
    ]


def test_shift_enter_adds_a_line_and_enter_sends(
    server: ThreadServer, pages: Pages, project: Path
) -> None:
    page = pages.open(server)
    open_workspace(page, project)
    page.click("#prompt")
    page.keyboard.type("first line")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("second line")
    assert page.input_value("#prompt") == "first line\nsecond line"
    expect(page.locator(".message")).to_have_count(0)
    page.keyboard.press("Enter")
    wait_for_run(page, "completed")
    expect(page.locator(".message.role-user .user-text")).to_have_text("first line\nsecond line")


def test_queue_two_prompts_then_clear(server: ThreadServer, pages: Pages, project: Path) -> None:
    page = pages.open(server)
    open_workspace(page, project)
    send(page, words(150, "long"))
    wait_for_run(page, "running")
    send(page, "second prompt")
    send(page, "third prompt")
    queue_bar = page.locator("#queue-bar")
    expect(queue_bar).to_be_visible()
    expect(page.locator("#queue-count")).to_have_text("2 queued prompts")
    expect(page.locator("#queue-list li")).to_have_text(["second prompt", "third prompt"])
    wait_for_run(page, "queued", 2)

    page.click("#clear-queue")
    expect(queue_bar).to_be_hidden()
    wait_for_run(page, "cancelled", 2)
    wait_for_run(page, "running", 1)

    page.click("#cancel-run")
    wait_for_run(page, "cancelled", 3)
    # The cleared prompts never ran: one user message, one (cancelled) reply.
    expect(page.locator(".message.role-user")).to_have_count(1)
    expect(page.locator(".message.role-assistant")).to_have_count(1)


def test_cancel_a_long_run(server: ThreadServer, pages: Pages, project: Path) -> None:
    page = pages.open(server)
    open_workspace(page, project)
    prompt = words(200, "c")
    send(page, prompt)
    page.wait_for_function(
        "() => document.querySelector('.message.role-assistant .markdown')"
        "?.textContent.includes('c5')",
        timeout=WAIT_MS,
    )
    page.click("#cancel-run")
    wait_for_run(page, "cancelled")
    finish = page.locator(".message.role-assistant .finish")
    expect(finish).to_have_attribute("data-reason", "canceled")
    expect(finish).to_contain_text("Cancelled")
    expect(page.locator(".session[data-busy='false']")).to_have_count(1)
    (text,) = assistant_texts(page)
    assert prompt.startswith(text)
    assert 0 < len(text) < len(prompt)


def _reconnect_mid_run(server: ThreadServer, page: Page, project: Path, tag: str) -> str:
    """Send a prompt, drop the socket mid-run, and check the reply arrives whole, once."""
    open_workspace(page, project)
    prompt = words(120, tag)
    send(page, prompt)
    page.wait_for_function(
        f"() => document.querySelector('.message.role-assistant .markdown')"
        f"?.textContent.includes('{tag}3 ')",
        timeout=WAIT_MS,
    )
    wid = page.evaluate("window.crushTrio.wid")
    with server.http() as http:
        r = http.post(f"/v1/workspaces/{wid}/debug/drop-streams")
    assert r.status_code == 200, r.text
    assert r.json()["dropped"] >= 1
    page.wait_for_function("() => window.crushTrio.stats.connects >= 2", timeout=WAIT_MS)
    expect(page.locator("#connection")).to_have_attribute("data-state", "open")

    wait_for_run(page, "completed")
    expect(page.locator(".message.role-assistant .markdown")).to_have_text(prompt)
    assert assistant_texts(page) == [prompt]
    expect(page.locator(".message.role-user")).to_have_count(1)
    return prompt


def test_reconnect_resumes_after_the_server_drops_the_socket(
    server: ThreadServer, pages: Pages, project: Path
) -> None:
    page = pages.open(server)
    _reconnect_mid_run(server, page, project, "r")
    stats = page.evaluate("window.crushTrio.stats")
    assert stats["resumes"] >= 1, stats
    assert stats["gaps"] == 0, f"the replay buffer covered the outage: {stats}"


def test_reconnect_after_a_lost_replay_refetches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pages: Pages, project: Path
) -> None:
    """With a one-event replay buffer the resume finds events gone: a gap, then a refetch."""
    config = {**ECHO_CONFIG, "server": {"replay_buffer": 1}}
    server = _start_server(tmp_path, monkeypatch, config)
    try:
        page = pages.open(server)
        _reconnect_mid_run(server, page, project, "g")
        stats = page.evaluate("window.crushTrio.stats")
        assert stats["gaps"] >= 1, stats
        assert stats["resyncs"] >= 2, stats
    finally:
        server.stop()


def test_model_output_with_markup_is_shown_as_text(
    server: ThreadServer, pages: Pages, project: Path
) -> None:
    page = pages.open(server)
    open_workspace(page, project)
    payload = (
        '<script>window.__pwned = 1</script> <img src=x onerror="window.__pwned = 2"> '
        "[link](javascript:window.__pwned=3) <b>bold?</b>"
    )
    send(page, payload)
    wait_for_run(page, "completed")
    reply = page.locator(".message.role-assistant .markdown")
    expect(reply).to_contain_text("<script>window.__pwned = 1</script>")
    expect(reply).to_contain_text('<img src=x onerror="window.__pwned = 2">')
    expect(reply).to_contain_text("<b>bold?</b>")
    conversation = page.locator("#conversation")
    assert conversation.locator("script, img, b, iframe").count() == 0
    assert conversation.locator("a").count() == 0, "javascript: links are not made links"
    assert page.evaluate("window.__pwned") is None


def test_sessions_create_select_delete(server: ThreadServer, pages: Pages, project: Path) -> None:
    page = pages.open(server)
    open_workspace(page, project)
    send(page, "hello first session")
    wait_for_run(page, "completed")
    sessions = page.locator("#session-list .session")
    expect(sessions).to_have_count(1)

    page.click("#new-session")
    expect(sessions).to_have_count(2)
    expect(page.locator(".message")).to_have_count(0)
    expect(page.locator(".session.current .session-title")).to_have_text("New session")
    send(page, "hello second session")
    wait_for_run(page, "completed")
    expect(page.locator(".message.role-assistant .markdown")).to_have_text("hello second session")

    # Switch back: the first session's messages, and not the second's.
    page.locator(".session:not(.current) .session-open").click()
    expect(page.locator(".message.role-assistant .markdown")).to_have_text("hello first session")

    # Delete needs a second press.
    delete = page.locator(".session.current .session-delete")
    delete.click()
    expect(sessions).to_have_count(2)
    page.locator(".session.current .session-delete").click()
    expect(sessions).to_have_count(1)
    expect(page.locator(".message.role-assistant .markdown")).to_have_text("hello second session")


def test_rename_a_session(server: ThreadServer, pages: Pages, project: Path) -> None:
    page = pages.open(server)
    open_workspace(page, project)
    page.click("#new-session")
    expect(page.locator("#session-list .session")).to_have_count(1)
    sid = page.evaluate("window.crushTrio.current")
    wid = page.evaluate("window.crushTrio.wid")
    with server.http() as http:
        probe = http.patch(f"/v1/workspaces/{wid}/sessions/{sid}", json={"title": "probe"})
    if probe.status_code in (404, 405):
        pytest.skip("needs PATCH /v1/workspaces/{wid}/sessions/{sid} to rename sessions")
    page.click(".session.current .session-rename")
    page.fill(".rename-input", "Renamed here")
    page.press(".rename-input", "Enter")
    expect(page.locator(".session.current .session-title")).to_have_text("Renamed here")
    expect(page.locator("#session-title")).to_have_text("Renamed here")


def test_narrow_dark_window_is_usable_by_keyboard(
    server: ThreadServer, pages: Pages, project: Path
) -> None:
    page = pages.open(server, viewport={"width": 390, "height": 760}, color_scheme="dark")
    sidebar = page.locator("#sidebar")
    expect(sidebar).to_be_hidden()
    toggle = page.locator("#toggle-sidebar")
    expect(toggle).to_have_attribute("aria-expanded", "false")
    page.fill("#workspace-path", str(project / "missing"))
    page.press("#workspace-path", "Enter")
    expect(page.locator("#toasts .toast")).to_contain_text("Cannot open")
    open_workspace(page, project)
    send(page, "narrow window reply")
    wait_for_run(page, "completed")
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, "nothing overflows a phone-sized window"

    toggle.focus()
    page.keyboard.press("Enter")
    expect(sidebar).to_be_visible()
    expect(toggle).to_have_attribute("aria-expanded", "true")
    page.keyboard.press("Escape")
    expect(sidebar).to_be_hidden()
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert background == "rgb(21, 22, 27)", "the dark theme follows the system"
    # Every control has a name a screen reader can announce.
    unnamed = page.evaluate(
        """() => [...document.querySelectorAll('button, input, textarea')]
            .filter((el) => el.offsetParent !== null)
            .filter((el) => !(el.labels && el.labels.length) && !el.getAttribute('aria-label')
                && !el.textContent.trim())
            .map((el) => el.outerHTML)"""
    )
    assert unnamed == []
    screenshot(page, "web-narrow-dark.png")


def test_permission_request_is_answered_in_one_tab_and_gone_from_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pages: Pages, project: Path
) -> None:
    model = ScriptedModel(
        [Step(tool_calls=[("write", {"path": "hello.txt", "content": "hi"})]), Step(text="wrote")]
    )
    server = _start_server(tmp_path, monkeypatch, ECHO_CONFIG, provider_factory=model)
    try:
        first = pages.open(server)
        open_workspace(first, project)
        send(first, "please write hello.txt")
        expect(first.locator(".permission")).to_have_count(1)
        # A tab opened after the request was asked still shows it.
        second = pages.open(server, hash=f"#path={quote(str(project))}", context=first.context)
        expect(second.locator("#connection")).to_have_attribute("data-state", "open")
        for page in (first, second):
            card = page.locator(".permission")
            expect(card).to_have_count(1)
            expect(card).to_contain_text("write")
        second.locator('.permission button[data-action="allow"]').click()
        for page in (first, second):
            expect(page.locator(".permission")).to_have_count(0)
        wait_for_run(first, "completed")
        expect(first.locator('.tool-call[data-status="done"]')).to_have_count(1)
        assert (project / "hello.txt").read_text() == "hi"
    finally:
        server.stop()


def test_the_todo_list_shows_as_a_checklist_that_updates_live_in_two_tabs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pages: Pages, project: Path
) -> None:
    plan = [
        {"content": "Find the bug", "status": "in_progress", "active_form": "Finding the bug"},
        {"content": "Fix <b>it</b>", "status": "pending"},
    ]
    done = [
        {"content": "Find the bug", "status": "completed", "active_form": "Finding the bug"},
        {"content": "Fix <b>it</b>", "status": "in_progress", "active_form": "Fixing it"},
    ]
    model = ScriptedModel(
        [
            Step(tool_calls=[("todos", {"todos": plan})]),
            # A permission request holds the turn while both tabs show the first list.
            Step(tool_calls=[("write", {"path": "fix.txt", "content": "fixed"})]),
            Step(tool_calls=[("todos", {"todos": done})]),
            Step(text="fixed"),
        ]
    )
    server = _start_server(tmp_path, monkeypatch, ECHO_CONFIG, provider_factory=model)
    try:
        first = pages.open(server)
        open_workspace(first, project)
        send(first, "fix the bug")
        expect(first.locator(".permission")).to_have_count(1)
        second = pages.open(server, hash=f"#path={quote(str(project))}", context=first.context)
        expect(second.locator("#connection")).to_have_attribute("data-state", "open")
        for page in (first, second):
            items = page.locator("#todos .todo")
            expect(items).to_have_count(2)
            expect(items.nth(0)).to_have_attribute("data-status", "in_progress")
            expect(items.nth(0)).to_contain_text("Finding the bug")
            expect(items.nth(1)).to_contain_text("Fix <b>it</b>")  # text, never markup
            expect(page.locator("#todos summary")).to_contain_text("0 of 2 done")
        first.locator('.permission button[data-action="allow"]').click()
        wait_for_run(first, "completed")
        for page in (first, second):
            items = page.locator("#todos .todo")
            expect(items.nth(0)).to_have_attribute("data-status", "completed")
            expect(items.nth(1)).to_have_attribute("data-status", "in_progress")
            expect(items.nth(1)).to_contain_text("Fixing it")
            expect(page.locator("#todos summary")).to_contain_text("1 of 2 done")
        screenshot(first, "web-todos.png")
    finally:
        server.stop()


MARKDOWN_CASES: list[tuple[str, str]] = [
    (
        "*em* **strong** `co*de*` ~~del~~ snake_case_name",
        "<p><em>em</em> <strong>strong</strong> <code>co*de*</code> <del>del</del> "
        "snake_case_name</p>",
    ),
    ("# Title\nline one\nline two", '<h3 class="md-h md-h1">Title</h3><p>line one<br>line two</p>'),
    (
        "```py\nif a < b:\n```",
        '<div class="code-block"><span class="code-lang">py</span><pre tabindex="0">'
        '<code class="language-py"><span class="code-lines">if a &lt; b:</span></code></pre></div>',
    ),
    (
        "```\nstill streaming <b>",
        '<div class="code-block"><pre tabindex="0"><code><span class="code-lines">'
        "still streaming &lt;b&gt;</span></code></pre></div>",
    ),
    (
        "- a\n  - nested\n- b\n\n3. three",
        "<ul><li><p>a</p><ul><li>nested</li></ul></li><li>b</li></ul>"
        '<ol start="3"><li>three</li></ol>',
    ),
    ("> quoted **b**", "<blockquote><p>quoted <strong>b</strong></p></blockquote>"),
    (
        "| a | b |\n|--|--:|\n| 1 | 2 |",
        '<div class="table-wrap"><table><thead><tr><th>a</th><th data-align="right">b</th></tr>'
        '</thead><tbody><tr><td>1</td><td data-align="right">2</td></tr></tbody></table></div>',
    ),
    (
        "[ok](https://example.org/a_(b)) [bad](javascript:alert(1)) [rel](/v1/control)",
        '<p><a href="https://example.org/a_(b)" target="_blank" '
        'rel="noopener noreferrer nofollow">ok</a> bad rel</p>',
    ),
    (
        '<script>alert(1)</script> <img src=x onerror="alert(1)">',
        '<p>&lt;script&gt;alert(1)&lt;/script&gt; &lt;img src=x onerror="alert(1)"&gt;</p>',
    ),
    ("\\*literal\\* **unclosed", "<p>*literal* **unclosed</p>"),
]


def test_markdown_renderer(server: ThreadServer, pages: Pages) -> None:
    """The renderer the page uses, on the constructs models write (and on markup)."""
    page = pages.open(server)
    html = page.evaluate(
        """async (sources) => {
            const { renderMarkdown } = await import('./static/markdown.js');
            return sources.map((source) => {
                const box = document.createElement('div');
                box.append(renderMarkdown(source));
                return box.innerHTML;
            });
        }""",
        [source for source, _ in MARKDOWN_CASES],
    )
    # Open blocks (here: all, as the last line of each ends the text) are the element's children.
    assert html == [expected for _, expected in MARKDOWN_CASES]
    # A final block (the lines that decided its end are complete) goes into div.md-final's runs;
    # a code block's lines come in spans of 32, each but the last ending with its newline.
    code = [f"l{k}" for k in range(40)]
    # A run that holds RUN_BLOCKS (64) final blocks is marked full.
    final, spans, runs = page.evaluate(
        """async ([source, code, many]) => {
            const { renderMarkdown } = await import('./static/markdown.js');
            const render = (text) => {
                const box = document.createElement('div');
                box.append(renderMarkdown(text));
                return box;
            };
            return [
                render(source).innerHTML,
                [...render(code).querySelectorAll('code > span')].map((s) => s.textContent),
                [...render(many).querySelectorAll('.md-run')].map((r) => [r.className, r.childElementCount]),
            ];
        }""",
        ["a\n\nb\nc", "```\n" + "\n".join(code), "\n\n".join(f"p{k}" for k in range(70))],
    )
    assert final == '<div class="md-final"><div class="md-run"><p>a</p></div></div><p>b<br>c</p>'
    assert spans == ["\n".join(code[:32]) + "\n", "\n".join(code[32:])]
    # (Of the 70 paragraphs the last two are open: the line after the blank one is incomplete.)
    assert runs == [["md-run md-full", 64], ["md-run", 4]]


def test_trust_bar_lists_ignored_keys_and_its_button_trusts_the_workspace(
    pages: Pages, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An untrusted workspace's crush.json that pre-approves tools shows the trust bar; its button
    (after the confirmation dialog) records the trust and applies the file."""
    monkeypatch.setenv("CRUSH_TRIO_DEBUG_ROUTES", "1")
    user_config = tmp_path / "user-config"
    user_config.mkdir()
    (user_config / "crush.json").write_text(json.dumps(ECHO_CONFIG))
    project = tmp_path / "untrusted"
    project.mkdir()
    (project / "crush.json").write_text(json.dumps({"permissions": {"allowed_tools": ["bash"]}}))
    server = ThreadServer(
        ServeOptions(
            host="127.0.0.1",
            port=0,
            data_dir=tmp_path / "data",
            token=TOKEN,
            user_config_dir=user_config,
            access_log=False,
        )
    )
    server.start()
    try:
        page = pages.open(server)
        open_workspace(page, project)
        bar = page.locator("#trust-bar")
        expect(bar).to_be_visible()
        expect(page.locator("#trust-warnings li")).to_have_count(1)
        expect(page.locator("#trust-warnings li")).to_contain_text("$.permissions")
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("#trust-workspace")
        expect(bar).to_be_hidden()
        saved = json.loads((user_config / "crush.json").read_text())
        assert saved["trusted_workspaces"] == [str(project.resolve())]
        assert saved["providers"] == ECHO_CONFIG["providers"]
        with server.http() as http:
            (info,) = http.get("/v1/workspaces").json()
        assert info["trusted"] is True
        assert server.workspace(info["id"]).permissions.allowed_tools == frozenset({"bash"})
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------
# Incremental rendering and message deltas

#: Markdown blocks that models write, with the constructs whose extent depends on later lines.
MARKDOWN_BLOCKS: list[str] = [
    "# Heading one",
    "### A smaller heading with `code`",
    "A paragraph with **strong**, *em*, `inline code` and a [link](https://example.org).\n"
    "It goes on over a second line with snake_case_names.",
    "Short paragraph.",
    "```python\ndef f(x):\n    return x * 2\n\n\nprint(f(3))\n```",
    "~~~\nplain fence with ``` inside\n~~~",
    "- first item\n- second item with **bold**\n  continued lazily\n- third\n  - nested one\n"
    "  - nested two",
    "1. one\n2. two\n\n3. three after a blank line",
    "- [ ] task open\n- [x] task done",
    "> a quote\n> over two lines",
    "| col a | col b |\n|---|:-:|\n| 1 | 2 |\n| 3 | 4 |",
    "text line | with a bar\n|---|---|\n| becomes | a table |",
    "---",
    "Emoji 😀 and accents é, and <b>markup</b> kept as text.",
    "- item\n\n  a second paragraph in the item\n\n- next item",
]


def markdown_document(rng: random.Random, blocks: int) -> str:
    """Blocks joined by one or two newlines (one newline lets a block run into the next)."""
    out = []
    for k in range(blocks):
        out.append(rng.choice(MARKDOWN_BLOCKS))
        if k < blocks - 1:
            out.append(rng.choice(["\n\n", "\n\n", "\n", "\n\n\n", "\r\n\r\n"]))
    if rng.random() < 0.3:
        out.append("\n```js\nan unterminated fence at the end")
    return "".join(out)


def chunked(rng: random.Random, text: str, longest: int) -> list[str]:
    pieces = []
    i = 0
    while i < len(text):
        n = rng.randint(1, longest)
        pieces.append(text[i : i + n])
        i += n
    return pieces


def test_incremental_markdown_equals_a_full_render(server: ThreadServer, pages: Pages) -> None:
    """After every append, in random chunkings, the streamed Markdown is exactly what a full
    render of the text so far gives; a text that does not extend the old one is rendered anew."""
    page = pages.open(server)
    rng = random.Random(1717)
    cases = []
    for _ in range(60):
        text = markdown_document(rng, rng.randint(1, 9))
        cases.append(chunked(rng, text, rng.choice([1, 3, 12, 60])))
    for _ in range(4):  # across the boundaries of runs of blocks
        cases.append(chunked(rng, markdown_document(rng, 200), 40))
    for _ in range(6):  # long code blocks, open and closed: across their spans of lines
        lines = [f"    line {k}" + " x" * rng.randint(0, 3) for k in range(rng.randint(30, 100))]
        fence = "```py\n" + rng.choice(["\n", "\r\n", "\n\n"]).join(lines)
        fence += rng.choice(["", "\n", "\n```", "\n```\nafter"])
        cases.append(chunked(rng, fence, rng.choice([1, 5, 40, 300])))
    mismatches = page.evaluate(
        """async (cases) => {
            const { MarkdownStream, renderMarkdown } = await import('./static/markdown.js');
            const full = (text) => {
                const box = document.createElement('div');
                box.append(renderMarkdown(text));
                return box.innerHTML;
            };
            const bad = [];
            cases.forEach((chunks, n) => {
                const md = new MarkdownStream();
                let text = '';
                chunks.forEach((chunk, k) => {
                    text += chunk;
                    // Half the cases get appends, half whole snapshots (the snapshot path).
                    if (n % 2) md.append(chunk); else md.set(text);
                    if (md.el.innerHTML !== full(text)) bad.push({ n, k, text, got: md.el.innerHTML });
                });
                // A snapshot that does not extend what is shown replaces it.
                const other = text.slice(0, Math.floor(text.length / 2)) + '\\n\\nchanged *tail*';
                md.set(other);
                if (md.el.innerHTML !== full(other)) bad.push({ n, k: -1, text: other, got: md.el.innerHTML });
            });
            return bad.slice(0, 3);
        }""",
        cases,
    )
    assert mismatches == []


def test_message_view_updates_equal_a_full_render(server: ThreadServer, pages: Pages) -> None:
    """A message that grows part by part (reasoning, text, a tool call, its result, the finish)
    is, after every update, the element a full render of the message gives."""
    page = pages.open(server)
    mismatches = page.evaluate(
        """async () => {
            const { MessageView, renderMessage } = await import('./static/render.js');
            const msg = { id: 'm1', session_id: 's', role: 'assistant', model: 'x', created_at: 1, parts: [] };
            const results = new Map();
            const ctx = () => ({ results, calls: new Set(['c1']), toggles: new Map() });
            const view = new MessageView();
            const bad = [];
            const check = (step) => {
                const got = view.update(msg, ctx()).outerHTML;
                const want = renderMessage(msg, ctx()).outerHTML;
                if (got !== want) bad.push({ step, got, want });
            };
            check('empty');
            msg.parts.push({ type: 'reasoning', data: { thinking: '', signature: '', started_at: 1, finished_at: 0 } });
            for (const t of ['Let me ', 'think ', 'about it.']) { msg.parts[0].data.thinking += t; check('reasoning'); }
            msg.parts[0].data.finished_at = 2;
            check('reasoning finished');
            msg.parts.push({ type: 'text', data: { text: '' } });
            for (const t of ['# Plan\\n', '\\n- one', '\\n- two\\n\\n```sh\\nls', ' -l\\n```\\n\\nDone.']) {
                msg.parts[1].data.text += t;
                check('text');
            }
            msg.parts.push({ type: 'tool_call', data: { id: 'c1', name: 'bash', input: '', finished: false } });
            for (const t of ['{"comm', 'and": "ls"', '}']) { msg.parts[2].data.input += t; check('tool input'); }
            msg.parts[2].data.finished = true;
            check('tool finished');
            results.set('c1', { tool_call_id: 'c1', name: 'bash', content: 'a\\nb', is_error: false });
            check('tool result');
            msg.parts.push({ type: 'finish', data: { reason: 'tool_use', time: 3 } });
            check('finished');
            // A snapshot whose text does not extend the old one (the text was replaced).
            msg.parts[1].data.text = 'Another *text*';
            check('replaced text');
            return bad;
        }"""
    )
    assert mismatches == []


def test_page_asks_for_deltas_and_applies_them_by_offset(
    server: ThreadServer, pages: Pages, project: Path
) -> None:
    """The page opens its websocket with deltas=1 and applies message_delta events: appends,
    overlaps (only the uncovered tail), offsets in code points, new parts, a snapshot that
    supersedes assembled text, and missing text (offset > have) that makes it re-read."""
    page = pages.open(server)
    sockets: list[str] = []
    page.on("websocket", lambda ws: sockets.append(ws.url))
    open_workspace(page, project)
    assert sockets, sockets
    assert all("deltas=1" in url for url in sockets), sockets
    prompt = "stored reply " + words(8, "s")
    send(page, prompt)
    wait_for_run(page, "completed")
    expect(page.locator(".message.role-assistant .markdown")).to_have_text(prompt)

    inject = """([type, kind, payload]) => {
        const app = window.crushTrio;
        payload = { session_id: app.current, ...payload };
        app.onFrame({ seq: app.lastSeq + 1, type, payload: { type: kind, payload } });
    }"""

    def delta(part: int, offset: int, text: str, part_type: str = "text", **extra: str) -> None:
        payload: dict[str, Any] = {"message_id": "m-delta", "part": part, "part_type": part_type}
        payload.update(offset=offset, text=text, **extra)
        page.evaluate(inject, ["message_delta", "updated", payload])

    created = {"id": "m-delta", "role": "assistant", "model": "m", "created_at": 1, "parts": []}
    page.evaluate(inject, ["message", "created", created])
    reply = page.locator('.message[data-message-id="m-delta"] .markdown')
    delta(0, 0, "Hello ")
    delta(0, 6, "wor")
    delta(0, 3, "lo world")  # overlaps "lo wor": only "ld" is new
    delta(0, 0, "Hello")  # entirely covered: nothing
    delta(0, 11, "😀!")  # two code points, three UTF-16 units
    delta(0, 13, " ok")
    expect(reply).to_have_text("Hello world😀! ok")
    delta(1, 0, '{"a":', "tool_call", tool_call_id="call-1", tool_name="bash")
    delta(1, 5, " 1}", "tool_call")
    call = page.locator(
        '.message[data-message-id="m-delta"] .tool-call[data-tool-call-id="call-1"]'
    )
    expect(call.locator(".tool-name")).to_have_text("bash")
    expect(call.locator(".tool-input")).to_have_text('{\n  "a": 1\n}')

    # A snapshot supersedes what was assembled; deltas then continue from it.
    snapshot = {**created, "parts": [{"type": "text", "data": {"text": "Replaced text"}}]}
    page.evaluate(inject, ["message", "updated", snapshot])
    expect(reply).to_have_text("Replaced text")
    delta(0, 13, " more")
    expect(reply).to_have_text("Replaced text more")
    assert page.evaluate("window.crushTrio.stats.rereads") == 0

    # Missing text: the page re-reads the messages and shows the stored reply again.
    stored = page.evaluate(
        "[...window.crushTrio.messages.values()].find((m) => m.role === 'assistant'"
        " && m.id !== 'm-delta')"
    )
    truncated = {**stored, "parts": [{"type": "text", "data": {"text": prompt[:5]}}]}
    page.evaluate(inject, ["message", "updated", truncated])
    first = page.locator(f'.message[data-message-id="{stored["id"]}"] .markdown')
    expect(first).to_have_text(prompt[:5])
    payload = {"message_id": stored["id"], "part": 0, "part_type": "text", "offset": 9}
    page.evaluate(inject, ["message_delta", "updated", {**payload, "text": "zz"}])
    expect(first).to_have_text(prompt)
    assert page.evaluate("window.crushTrio.stats.rereads") == 1
    # The re-read is the stored state: the message only this page had assembled is gone.
    expect(page.locator('.message[data-message-id="m-delta"]')).to_have_count(0)


def test_the_page_websocket_negotiates_permessage_deflate(
    server: ThreadServer, pages: Pages, project: Path
) -> None:
    """Chromium offers permessage-deflate; the server accepts it, and the page reads the
    compressed stream as it would an uncompressed one."""
    page = pages.open(server)
    cdp = page.context.new_cdp_session(page)
    cdp.send("Network.enable")
    answers: list[dict[str, str]] = []
    cdp.on(
        "Network.webSocketHandshakeResponseReceived",
        lambda event: answers.append(
            {k.lower(): v for k, v in event["response"]["headers"].items()}
        ),
    )
    open_workspace(page, project)
    prompt = "compressed reply " + words(12, "z")
    send(page, prompt)
    wait_for_run(page, "completed")
    expect(page.locator(".message.role-assistant .markdown")).to_have_text(prompt)
    assert answers, "no websocket handshake seen"
    assert all(
        a.get("sec-websocket-extensions", "").startswith("permessage-deflate") for a in answers
    ), answers


#: The long reply of the rendering benchmark (tokens; ~4 characters each, so ~80k characters).
LONG_REPLY_TOKENS = 20_000
#: Target: main-thread time per applied delta, 95th percentile, at LONG_REPLY_TOKENS (ms).
DELTA_P95_TARGET_MS = 2.0
#: Target: total time for a reply 4x longer, as a multiple of the shorter one's.
LONGER_REPLY_RATIO_TARGET = 5.0
#: What the test asserts of the ratios (CPU time, and wall time of the fastest 95% of deltas):
#: linear rendering stays near 4x (4.4-4.5x measured), rendering whose cost per delta grows with
#: the reply makes it up to 16x; the margin above the 5x target keeps one loaded run from
#: failing a build (the shorter reply's CPU time alone moved by 24% between two timings).
LONGER_REPLY_RATIO_GUARD = 8.0
#: performance.now() measures wall time, and on a loaded 2-core machine other processes' time
#: slices land in it: the wall p95 moves with the load (1.1-3.3 ms for the same code at load
#: averages 4-6; docs/performance.md, "Browser rendering"). The main-thread CPU time of each
#: delta's task, read from Chromium's trace (`tdur` of the task's FunctionCall event), does not
#: count other processes, so the test asserts the p95 target on it (1.07 ms measured) and the
#: guard above on the ratio of its totals. Of the wall time it asserts the median and the guard,
#: and prints the rest.
#: The named function that applies and renders one delta (one task each; found in the trace).
DELTA_TASK = "renderOneDelta"
#: The trace's categories: FunctionCall, Layout and UpdateLayoutTree events, with thread time.
TRACE_CATEGORIES = ["devtools.timeline"]


def reply_tokens(rng: random.Random, count: int) -> list[str]:
    """``count`` tokens of a Markdown reply (a word with its leading space, or a newline run)."""
    text = ""
    while True:
        text += markdown_document(rng, 40).replace("\r", "") + "\n\n"
        tokens = re.findall(r"\n+|[ \t]*[^\s]+", text)
        if len(tokens) >= count:
            return tokens[:count]


def render_long_reply(
    page: Page, tokens: list[str], message_id: str, snapshots: bool = False, trace: bool = True
) -> dict[str, Any]:
    """Feed ``tokens`` as message_delta events (or, with ``snapshots``, as whole ``message``
    updates, as a server sends to a client that did not ask for deltas) through the page's real
    apply path, one update per task and one render per update (the worst case of the page's
    once-per-frame rendering), a frame every 20 tasks. Each task applies, renders and forces the
    layout (reads the conversation's scroll height), and is timed with performance.now() (wall
    time) and, with ``trace``, by Chromium's trace (main-thread CPU time)."""
    browser = page.context.browser
    assert browser is not None
    if trace:
        browser.start_tracing(page=page, categories=TRACE_CATEGORIES)
    figures: dict[str, Any] = page.evaluate(
        """async ([tokens, id, snapshots]) => {
            const app = window.crushTrio;
            const { renderMarkdown } = await import('./static/markdown.js');
            app.replaceMessages([]);
            const longTasks = [];
            const observer = new PerformanceObserver((list) => {
                for (const e of list.getEntries()) longTasks.push(e.duration);
            });
            observer.observe({ type: 'longtask' });
            const sid = app.current;
            const box = document.getElementById('conversation');
            const frame = (type, payload) =>
                app.onFrame({ seq: app.lastSeq + 1, type, payload: { type: 'updated', payload } });
            frame('message', { id, session_id: sid, role: 'assistant', model: 'm', created_at: 1, parts: [] });
            app.flushRender();
            const times = new Float64Array(tokens.length);
            const channel = new MessageChannel();
            let offset = 0;
            let whole = '';
            let i = 0;
            await new Promise((done) => {
                channel.port1.onmessage = function renderOneDelta() {
                    const text = tokens[i];
                    whole += text;
                    const t0 = performance.now();
                    if (snapshots) {
                        const parts = [{ type: 'text', data: { text: whole } }];
                        frame('message', { id, session_id: sid, role: 'assistant', model: 'm', created_at: 1, parts });
                    } else {
                        frame('message_delta', { message_id: id, session_id: sid, part: 0, part_type: 'text', offset, text });
                    }
                    app.flushRender();
                    void box.scrollHeight;
                    times[i] = performance.now() - t0;
                    for (const _ of text) offset++;
                    i++;
                    // The next delta in a task of its own; a frame (paint) every 20 deltas.
                    if (i === tokens.length) done();
                    else if (i % 20) channel.port2.postMessage(0);
                    else requestAnimationFrame(() => channel.port2.postMessage(0));
                };
                channel.port2.postMessage(0);
            });
            await new Promise((r) => requestAnimationFrame(r));
            observer.disconnect();
            const el = document.querySelector(`.message[data-message-id="${id}"] .markdown`);
            const full = document.createElement('div');
            full.append(renderMarkdown(tokens.join('')));
            const sorted = [...times].sort((a, b) => a - b);
            const q = (p) => sorted[Math.min(sorted.length - 1, Math.floor(p * sorted.length))];
            return {
                chars: tokens.join('').length,
                total_ms: times.reduce((a, b) => a + b, 0),
                // The fastest 95%: the work without the other processes' time slices.
                trimmed_ms: sorted.slice(0, Math.floor(0.95 * sorted.length)).reduce((a, b) => a + b, 0),
                p50_ms: q(0.5), p95_ms: q(0.95), p99_ms: q(0.99), max_ms: sorted[sorted.length - 1],
                long_tasks: longTasks.length, long_task_ms: longTasks.reduce((a, b) => a + b, 0),
                equal: el.innerHTML === full.innerHTML,
            };
        }""",
        [tokens, message_id, snapshots],
    )
    if trace:
        figures.update(delta_cpu_times(browser.stop_tracing(), len(tokens)))
    return figures


def quantile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def delta_cpu_times(trace: bytes, count: int) -> dict[str, Any]:
    """The main-thread CPU time (``tdur``) of each delta's task in a Chromium trace, and the
    part of it spent in style (UpdateLayoutTree) and layout (Layout), in milliseconds."""
    events = json.loads(trace)["traceEvents"]
    tasks = sorted(
        (
            e
            for e in events
            if e.get("name") == "FunctionCall"
            and e.get("ph") == "X"
            and e.get("args", {}).get("data", {}).get("functionName") == DELTA_TASK
        ),
        key=lambda e: e["ts"],
    )
    if len(tasks) != count or any("tdur" not in e for e in tasks):
        return {"cpu": f"{len(tasks)} of {count} delta tasks with thread time in the trace"}
    thread = tasks[0]["tid"]
    inner = sorted(
        (
            e
            for e in events
            if e.get("tid") == thread
            and e.get("ph") == "X"
            and e.get("name") in ("Layout", "UpdateLayoutTree")
        ),
        key=lambda e: e["ts"],
    )
    cpu = [e["tdur"] / 1000 for e in tasks]
    split: dict[str, list[float]] = {"Layout": [0.0] * count, "UpdateLayoutTree": [0.0] * count}
    k = 0
    for n, task in enumerate(tasks):
        while k < len(inner) and inner[k]["ts"] < task["ts"]:
            k += 1
        while k < len(inner) and inner[k]["ts"] < task["ts"] + task["dur"]:
            split[inner[k]["name"]][n] += inner[k].get("tdur", inner[k]["dur"]) / 1000
            k += 1
    return {
        "cpu_total_ms": sum(cpu),
        "cpu_p50_ms": quantile(cpu, 0.5),
        "cpu_p95_ms": quantile(cpu, 0.95),
        "cpu_p99_ms": quantile(cpu, 0.99),
        "cpu_layout_p50_ms": quantile(split["Layout"], 0.5),
        "cpu_layout_p95_ms": quantile(split["Layout"], 0.95),
        "cpu_style_p50_ms": quantile(split["UpdateLayoutTree"], 0.5),
        "cpu_style_p95_ms": quantile(split["UpdateLayoutTree"], 0.95),
    }


def test_rendering_a_long_reply_costs_per_delta_not_per_reply(
    server: ThreadServer, pages: Pages, project: Path
) -> None:
    """A 20,000-token reply applied delta by delta, one render per delta (the worst case of the
    page's once-per-frame rendering): the main-thread CPU time of a delta's apply + render +
    layout is under 2 ms at the 95th percentile, and a 4x longer reply costs about 4x, not 16x
    (asserted against a guard, the 5x target's verdict printed). The figures are printed."""
    page = pages.open(server)
    open_workspace(page, project)
    page.click("#new-session")
    expect(page.locator("#session-list .session")).to_have_count(1)
    rng = random.Random(20_000)
    render_long_reply(page, reply_tokens(rng, 1_000), "warm-up", trace=False)
    short_tokens = reply_tokens(rng, LONG_REPLY_TOKENS // 4)
    short = render_long_reply(page, short_tokens, "short")
    long = render_long_reply(page, reply_tokens(rng, LONG_REPLY_TOKENS), "long")
    # The shorter reply again after the long one: the two bracket the long one in time, so a
    # change of the machine's load during the run weighs on both sides of the ratio.
    again = render_long_reply(page, short_tokens, "short-again")
    # A client in snapshot mode gets the whole text each time: rendered as an append too.
    snap = render_long_reply(page, reply_tokens(rng, LONG_REPLY_TOKENS), "snap", snapshots=True)
    ratio = 2 * long["total_ms"] / (short["total_ms"] + again["total_ms"])
    trimmed_ratio = 2 * long["trimmed_ms"] / (short["trimmed_ms"] + again["trimmed_ms"])
    print(f"\nbrowser rendering, {LONG_REPLY_TOKENS // 4} tokens: {json.dumps(short)}")
    print(f"browser rendering, {LONG_REPLY_TOKENS} tokens: {json.dumps(long)}")
    print(f"browser rendering, {LONG_REPLY_TOKENS // 4} tokens again: {json.dumps(again)}")
    print(f"browser rendering, {LONG_REPLY_TOKENS} tokens as snapshots: {json.dumps(snap)}")
    print(f"wall-time ratio for a 4x longer reply: {ratio:.2f} (fastest 95%: {trimmed_ratio:.2f})")
    assert all(r["equal"] for r in (short, long, again, snap)), "the reply equals a full render"
    assert long["p50_ms"] <= DELTA_P95_TARGET_MS, long
    # Each snapshot is also compared whole with the text shown (O(reply), but a memory compare):
    # its median stays far below a whole re-render's (tens of ms at this length).
    assert snap["p50_ms"] <= DELTA_P95_TARGET_MS, snap
    assert trimmed_ratio <= LONGER_REPLY_RATIO_GUARD, (trimmed_ratio, short, long, again)
    if "cpu_total_ms" not in long:
        pytest.skip(f"no CPU times in Chromium's trace: {long.get('cpu')}")
    cpu_ratio = 2 * long["cpu_total_ms"] / (short["cpu_total_ms"] + again["cpu_total_ms"])
    print(
        f"CPU per delta at {LONG_REPLY_TOKENS} tokens: p95 {long['cpu_p95_ms']:.2f} ms "
        f"(target {DELTA_P95_TARGET_MS}); CPU ratio for a 4x longer reply: {cpu_ratio:.2f} "
        f"(target {LONGER_REPLY_RATIO_TARGET})"
    )
    verdict = "met" if cpu_ratio <= LONGER_REPLY_RATIO_TARGET else "NOT met"
    print(f"target {LONGER_REPLY_RATIO_TARGET}x on CPU time: {verdict}")
    assert long["cpu_p95_ms"] <= DELTA_P95_TARGET_MS, long
    assert cpu_ratio <= LONGER_REPLY_RATIO_GUARD, (cpu_ratio, short, long, again)


def test_changes_panel_shows_a_runs_files_and_diff_and_reverts_it_after_a_conflict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pages: Pages, project: Path
) -> None:
    (project / "notes.txt").write_text("old line\n")
    model = ScriptedModel(
        [
            Step(
                tool_calls=[
                    ("view", {"path": "notes.txt"}),  # read before edit
                    ("write", {"path": "notes.txt", "content": "new line\n"}),
                ]
            ),
            Step(text="rewrote it"),
        ]
    )
    server = _start_server(tmp_path, monkeypatch, ECHO_CONFIG, provider_factory=model)
    try:
        page = pages.open(server)
        open_workspace(page, project)
        send(page, "rewrite notes.txt")
        card = page.locator(".permission")
        expect(card).to_have_count(1)
        # The permission card shows the change as a diff, not raw JSON.
        expect(card.locator("pre.diff .diff-add")).to_contain_text(["+new line"])
        expect(card.locator(".permission-params")).to_have_count(0)
        card.locator('button[data-action="allow"]').click()
        wait_for_run(page, "completed")
        panel = page.locator("#changes")
        expect(panel).to_be_visible()
        expect(panel.locator(".changes-run")).to_have_count(1)
        panel.locator(".changes-toggle").click()
        panel.locator('.changes-file[data-path="notes.txt"]').click()
        expect(panel.locator("pre.diff .diff-del")).to_contain_text(["-old line"])
        expect(panel.locator("pre.diff .diff-add")).to_contain_text(["+new line"])
        (project / "notes.txt").write_text("the user's edit\n")
        panel.locator(".changes-revert").click()
        conflict = panel.locator(".changes-conflict")
        expect(conflict).to_contain_text("notes.txt")
        assert (project / "notes.txt").read_text() == "the user's edit\n"
        conflict.locator("button").click()
        expect(panel.locator(".changes-conflict")).to_have_count(0)
        expect(page.locator(".toast").last).to_contain_text("Reverted 1 file")
        assert (project / "notes.txt").read_text() == "old line\n"
        screenshot(page, "changes-panel.png")
    finally:
        server.stop()
