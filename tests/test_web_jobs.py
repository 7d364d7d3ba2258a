"""The web page's running-commands and background-jobs panel (``crush_trio/web/jobs.js``), in
Chromium: a ``bash`` command's output shows while it runs and gives way to its result, and a
background job is listed with its output.

The command is held by a FIFO in the project that the test writes to once the page shows the
first line; every wait is bounded (``WAIT_MS``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import pytest
from playwright.sync_api import expect

from crush_trio.providers.scripted import ScriptedModel, Step

from .test_web_e2e import (  # noqa: F401 (browser and pages are fixtures)
    ECHO_CONFIG,
    Pages,
    _start_server,
    browser,
    open_workspace,
    pages,
    screenshot,
    send,
    wait_for_run,
)

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow

CONFIG: dict[str, Any] = {
    **ECHO_CONFIG,
    "permissions": {"allowed_tools": ["bash"]},
    "options": {"sandbox": {"enabled": False}},
}


def test_streaming_output_and_background_jobs_are_shown(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    pages: Pages,
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    os.mkfifo(project / "gate")
    model = ScriptedModel(
        [
            Step(tool_calls=[("bash", {"command": "echo live-one; read x < gate; echo live-two"})]),
            Step(
                tool_calls=[
                    ("bash", {"command": "echo job-line; exec sleep 300", "background": True})
                ]
            ),
            Step(text="all started"),
        ]
    )
    server = _start_server(tmp_path, monkeypatch, CONFIG, provider_factory=model)
    gate = os.open(project / "gate", os.O_RDWR | os.O_NONBLOCK)
    try:
        page = pages.open(server)
        open_workspace(page, project)
        send(page, "run things")
        live = page.locator("#jobs .live-command .live-output")
        expect(live).to_contain_text("live-one")  # while the command still waits on the gate
        expect(page.locator("#jobs")).to_be_visible()
        os.write(gate, b"go\n")
        wait_for_run(page, "completed")
        # The finished command's live view gave way to its result; the job is listed.
        expect(page.locator("#jobs .live-command")).to_have_count(0)
        job = page.locator("#jobs .job")
        expect(job).to_have_count(1)
        expect(job).to_have_attribute("data-state", "running")
        expect(job).to_contain_text("job-1")
        expect(job.locator(".live-output")).to_contain_text("job-line")
        screenshot(page, "web-jobs.png")
    finally:
        os.close(gate)
        server.stop()
