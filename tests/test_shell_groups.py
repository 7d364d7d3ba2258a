"""Ending a command's process group: live members are ended, zombies do not count.

An exited orphan stays a member of its group until init reaps it, and some container inits never
do (or only later), so ``end_group`` must tell a zombie from a live member without waiting for
init.
"""

from __future__ import annotations

import os
import signal
import subprocess
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import pytest
import trio

from crush_trio.tools.shell import KILL_GRACE, end_group

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

pytestmark = pytest.mark.slow


@asynccontextmanager
async def group_leader(argv: Sequence[str]) -> AsyncIterator[trio.Process]:
    """``argv`` as the first process of a new group, its stdout piped; killed and reaped at
    the end."""
    process = await trio.lowlevel.open_process(
        list(argv), start_new_session=True, stdout=subprocess.PIPE
    )
    try:
        yield process
    finally:
        process.kill()
        with trio.move_on_after(5, shield=True):
            await process.wait()
            if process.stdout is not None:
                await process.stdout.aclose()


async def test_a_live_member_is_ended_with_sigterm() -> None:
    async with group_leader(["sleep", "30"]) as leader:
        with trio.fail_after(KILL_GRACE):  # ended by SIGTERM, before any SIGKILL
            assert await end_group(leader.pid) is True
        with trio.fail_after(5):
            assert await leader.wait() == -signal.SIGTERM


async def test_a_group_whose_only_member_is_a_zombie_counts_as_empty() -> None:
    async with group_leader(["true"]) as child:
        # Wait for it to exit but leave it unreaped: a zombie, still a member of its group.
        with trio.fail_after(5):
            await trio.to_thread.run_sync(
                os.waitid, os.P_PID, child.pid, os.WEXITED | os.WNOWAIT, abandon_on_cancel=True
            )
        os.killpg(child.pid, 0)  # the group exists
        with trio.fail_after(1):  # no SIGTERM, and no wait for it to go
            assert await end_group(child.pid) is True


async def test_a_member_that_outlives_sigterm_gets_sigkill() -> None:
    async with group_leader(["sh", "-c", "trap '' TERM; echo ready; exec sleep 30"]) as leader:
        assert leader.stdout is not None
        with trio.fail_after(5):  # SIGTERM is ignored from here on
            assert await leader.stdout.receive_some() == b"ready\n"
        with trio.fail_after(KILL_GRACE + 2):
            assert await end_group(leader.pid) is False
        with trio.fail_after(5):
            assert await leader.wait() == -signal.SIGKILL
