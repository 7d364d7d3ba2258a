"""The page as a daily driver, in real headless Chromium: readable permission cards answered by
keyboard, the tab asking for attention while hidden, the side panel (usage, Summarize, agent), and
the page at desktop and phone width: screenshots for docs/web.md and an axe-core check.

Uses the harness of ``test_web_e2e`` (a server in its own thread, logged-in pages, bounded waits).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest
from axe_playwright_python.sync_playwright import Axe
from playwright.sync_api import Page, expect

from crush_trio.providers.scripted import ScriptedModel, Step

from .test_web_e2e import (  # noqa: F401 (browser, pages, project and server are fixtures)
    ECHO_CONFIG,
    ROOT,
    Pages,
    ThreadServer,
    _start_server,
    browser,
    open_workspace,
    pages,
    project,
    send,
    server,
    wait_for_run,
)

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow

#: Where the screenshots docs/web.md shows are written (committed with the docs).
SCREENSHOTS = ROOT / "docs" / "screenshots"
#: axe-core impacts that fail the check.
SERIOUS = {"serious", "critical"}


def test_permission_cards_read_as_what_they_do_and_answer_by_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pages: Pages, project: Path
) -> None:
    (project / "notes.txt").write_text("first line\nold words\nlast line\n")
    model = ScriptedModel(
        [
            Step(tool_calls=[("bash", {"command": "echo made > made.txt"})]),  # denied: ends
            Step(
                tool_calls=[
                    ("view", {"path": "notes.txt"}),
                    (
                        "edit",
                        {"path": "notes.txt", "old_string": "old words", "new_string": "new words"},
                    ),
                ]
            ),
            Step(text="edited"),
        ]
    )
    srv = _start_server(tmp_path, monkeypatch, ECHO_CONFIG, provider_factory=model)
    try:
        page = pages.open(srv)
        open_workspace(page, project)
        send(page, "make a file")
        card = page.locator(".permission")
        expect(card).to_have_count(1)
        # A command is shown as a command, with what it risks.
        expect(card.locator(".perm-command")).to_have_text("$ echo made > made.txt")
        expect(card.locator(".permission-risks")).to_contain_text("runs a program")
        expect(card.locator('button[data-action="deny"]')).to_have_attribute(
            "aria-keyshortcuts", "D"
        )
        # Typing in the prompt box never answers a card.
        page.focus("#prompt")
        page.keyboard.type("sad")
        expect(card).to_have_count(1)
        page.fill("#prompt", "")
        page.locator("#conversation").focus()
        page.keyboard.press("d")
        expect(card).to_have_count(0)
        wait_for_run(page, "completed")
        assert not (project / "made.txt").exists()

        send(page, "now edit the notes")
        expect(card).to_have_count(1)
        # An edit is shown as a diff of the lines it changes.
        expect(card.locator(".diff .diff-del")).to_have_text(["-old words"])
        expect(card.locator(".diff .diff-add")).to_have_text(["+new words"])
        page.locator("#conversation").focus()
        page.keyboard.press("a")
        expect(card).to_have_count(0)
        wait_for_run(page, "completed", count=2)
        assert (project / "notes.txt").read_text() == "first line\nnew words\nlast line\n"
    finally:
        srv.stop()


HIDDEN_TAB = """
window.__notes = [];
window.__hidden = false;
Object.defineProperty(document, "hidden", { get: () => window.__hidden });
window.Notification = class {
  static permission = "default";
  static async requestPermission() { window.Notification.permission = "granted"; return "granted"; }
  constructor(title, options) { window.__notes.push(options.body); }
  close() {}
};
"""


def set_hidden(page: Page, hidden: bool) -> None:
    page.evaluate(
        "(h) => { window.__hidden = h; document.dispatchEvent(new Event('visibilitychange')); }",
        hidden,
    )


def test_a_hidden_tab_counts_what_needs_you_and_notifies_once_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pages: Pages, project: Path
) -> None:
    model = ScriptedModel([Step(tool_calls=[("bash", {"command": "touch a"})])])
    srv = _start_server(tmp_path, monkeypatch, ECHO_CONFIG, provider_factory=model)
    try:
        context = pages.browser.new_context(viewport={"width": 1280, "height": 800})
        pages.contexts.append(context)
        context.add_init_script(HIDDEN_TAB)
        page = pages.open(srv, context=context)
        open_workspace(page, project)
        ask = page.locator("#ask-notify")
        expect(ask).to_be_visible()  # offered, never asked on its own
        assert page.evaluate("window.Notification.permission") == "default"
        ask.click()
        expect(ask).to_be_hidden()
        assert page.evaluate("window.Notification.permission") == "granted"
        title = page.title()
        set_hidden(page, True)
        send(page, "touch a file")
        expect(page).to_have_title(re.compile(r"^\(1\) "))
        notes = page.evaluate("window.__notes")
        assert len(notes) == 1
        assert "bash" in notes[0]
        set_hidden(page, False)
        expect(page).to_have_title(title)
        page.locator('.permission button[data-action="deny"]').click()
        wait_for_run(page, "completed")
    finally:
        srv.stop()


def test_side_panel_shows_usage_agent_and_summarizes(
    server: ThreadServer, pages: Pages, project: Path
) -> None:
    page = pages.open(server, viewport={"width": 1280, "height": 800})
    open_workspace(page, project)
    panel = page.locator("#panel")
    expect(panel).to_be_visible()
    expect(panel.locator("#agent-state")).to_contain_text("echo/echo")
    expect(panel.locator("#agent-state")).to_contain_text("Sandbox")
    expect(page.locator("#model-picker")).to_contain_text("Default (echo/echo)")
    send(page, "count my tokens please")
    wait_for_run(page, "completed")
    expect(page.locator("#usage-messages")).to_have_text("2")
    expect(page.locator("#usage-cost")).to_have_text(re.compile(r"^\$\d"))
    summarize = page.locator("#summarize")
    expect(summarize).to_be_enabled()
    summarize.click()
    expect(page.locator("#summarize-status")).to_contain_text("Summarized")


def check_accessibility(page: Page) -> None:
    results = Axe().run(page)
    serious = [
        (v["id"], v["help"], [n["target"] for n in v["nodes"]])
        for v in results.response["violations"]
        if v.get("impact") in SERIOUS
    ]
    assert serious == [], serious


@pytest.mark.parametrize(("width", "height"), [(1280, 800), (390, 844)])
def test_screenshots_and_accessibility(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    pages: Pages,
    project: Path,
    width: int,
    height: int,
) -> None:
    """The page people see, written to docs/screenshots/ for docs/web.md, passes axe-core."""
    plan = [
        {"content": "Read main.py", "status": "completed", "active_form": "Reading main.py"},
        {"content": "Run the tests", "status": "in_progress", "active_form": "Running the tests"},
        {"content": "Fix what fails", "status": "pending", "active_form": "Fixing what fails"},
    ]
    model = ScriptedModel(
        [
            Step(tool_calls=[("todos", {"todos": plan})]),
            Step(text="Here is the plan:\n\n1. **read** `main.py`\n2. run the tests"),
            Step(tool_calls=[("bash", {"command": "pytest -q tests/"})]),  # denied: ends
        ]
    )
    srv = _start_server(tmp_path, monkeypatch, ECHO_CONFIG, provider_factory=model)
    try:
        page = pages.open(srv, viewport={"width": width, "height": height})
        open_workspace(page, project)
        send(page, "Plan the work on main.py")
        wait_for_run(page, "completed")
        send(page, "run the tests")
        expect(page.locator(".permission")).to_have_count(1)
        expect(page.locator("#todos .todo")).to_have_count(3)
        check_accessibility(page)
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"web-{width}x{height}.png"))
        if width < 1200:
            page.locator("#toggle-panel").click()
            expect(page.locator("#panel")).to_be_visible()
            check_accessibility(page)
            page.screenshot(path=str(SCREENSHOTS / f"web-{width}x{height}-details.png"))
            page.keyboard.press("Escape")
            expect(page.locator("#panel")).to_be_hidden()
        assert page.evaluate("document.documentElement.scrollWidth") <= width
        page.locator('.permission button[data-action="deny"]').click()
        wait_for_run(page, "completed", count=2)
    finally:
        srv.stop()


def test_sessions_page_in_with_older_ones_on_demand_and_a_search_by_title(
    server: ThreadServer, pages: Pages, project: Path
) -> None:
    page = pages.open(server, viewport={"width": 1280, "height": 800})
    open_workspace(page, project)
    wid = page.evaluate("window.crushTrio.wid")
    with server.http() as http:
        for i in range(60):
            made = http.post(f"/v1/workspaces/{wid}/sessions", json={"title": f"topic {i:02d}"})
            assert made.status_code == 200, made.text
    page.reload()
    expect(page.locator("#connection")).to_have_attribute("data-state", "open")
    sessions = page.locator("#session-list .session")
    expect(sessions).to_have_count(50)  # the newest page only
    more = page.locator("#more-sessions")
    expect(more).to_be_visible()
    more.click()
    expect(sessions).to_have_count(60)
    expect(more).to_be_hidden()
    page.fill("#session-search", "topic 0")
    expect(sessions).to_have_count(10)  # topic 00 ... topic 09, found by the server
    expect(sessions.first).to_contain_text("topic 0")
    page.fill("#session-search", "no such topic")
    expect(sessions).to_have_count(0)
    expect(page.locator("#no-sessions")).to_contain_text("no such topic")
    page.fill("#session-search", "")
    expect(sessions).to_have_count(60)
