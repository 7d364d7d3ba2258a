"""The pytest plugin, as a downstream project uses it: sample test files run with ``pytester``.

The samples run in a pytest subprocess (``runpytest_subprocess``): they start their own trio run,
which cannot nest inside this one. The plugin is found through its ``pytest11`` entry point, as in
any project that installs crush-trio.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

pytestmark = pytest.mark.slow

#: Bound on one pytest subprocess (seconds).
CAP = 120

INI = """
[pytest]
trio_mode = true
filterwarnings =
    error
    ignore:Async generator .* was garbage collected:ResourceWarning
"""

DOCS = Path(__file__).resolve().parent.parent / "docs"


def run_samples(pytester: pytest.Pytester, **files: str) -> pytest.RunResult:
    pytester.makeini(INI)
    pytester.makepyfile(**{name: textwrap.dedent(code) for name, code in files.items()})
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=CAP)


def test_sample_downstream_tests_pass(pytester: pytest.Pytester) -> None:
    result = run_samples(
        pytester,
        test_downstream="""
            import trio

            from crush_trio.client import Client, RunStatus
            from crush_trio.providers.scripted import Gate, ScriptedModel, Step
            from crush_trio.testing import CrushServer


            async def test_three_fixtures(
                crush_server: CrushServer, crush_client: Client, scripted_model: ScriptedModel
            ) -> None:
                scripted_model.add(Step("scripted reply"))
                async with crush_client.workspace(crush_server.project()) as ws:
                    session = await ws.create_session()
                    run = await ws.run(session.id, "hi", timeout=10)
                assert run.status is RunStatus.COMPLETED
                assert run.text == "scripted reply"
                assert scripted_model.requests[-1].messages[-1].text() == "hi"
                assert crush_server.url.startswith("http://127.0.0.1:")


            async def test_gates_with_the_autojump_clock(
                crush_workspace, scripted_model, autojump_clock
            ) -> None:
                gate = Gate()
                scripted_model.add(Step("held then done", gate_mid=gate))
                session = await crush_workspace.create_session()
                handle = await crush_workspace.prompt(session.id, "go")
                with trio.fail_after(10):
                    await gate.reached.wait()
                start = trio.current_time()
                gate.release()
                assert (await handle.result(timeout=10)).text == "held then done"
                assert trio.current_time() - start < 10
        """,
    )
    result.assert_outcomes(passed=2)


def test_a_run_that_never_finishes_fails_with_a_clear_message(pytester: pytest.Pytester) -> None:
    result = run_samples(
        pytester,
        test_stuck="""
            from crush_trio.providers.scripted import Gate, Step


            async def test_forgot_to_release(crush_workspace, scripted_model, autojump_clock):
                scripted_model.add(Step("a b c d", gate_mid=Gate()))
                session = await crush_workspace.create_session()
                handle = await crush_workspace.prompt(session.id, "stuck")
                await handle.result(timeout=5)
        """,
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*Timeout*did not end within 5 s*last known status is running*",
            "*- crush_trio -*",
            "*step 1 (text 'a b c d') reached its gate_mid and it was never released*",
        ]
    )


def test_docs_examples_pass(pytester: pytest.Pytester) -> None:
    """Every Python block of docs/testing.md is a test module; they all pass."""
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "testing.md").read_text(), re.S)
    assert len(blocks) >= 2
    files = {f"test_docs_{n}": block for n, block in enumerate(blocks, 1)}
    expected = sum(len(re.findall(r"^async def test_", b, re.M)) for b in blocks)
    result = run_samples(pytester, **files)
    result.assert_outcomes(passed=expected)
