"""Session titles are plain text: Markdown in the model's title or in the prompt never shows."""

from __future__ import annotations

import pytest

from crush_trio.agent.titles import DEFAULT_TITLE, final_title, plain_text


@pytest.mark.parametrize(
    ("markdown", "plain"),
    [
        ("hello from the **browser**\n- item one\n-", "hello from the browser item one"),
        ("# Fix `parse_args` in [the docs](https://example.com/x)", "Fix parse_args in the docs"),
        ("snake_case_name and _emphasis_", "snake_case_name and emphasis"),
        ("***all*** ~~struck~~ <b>tags</b>", "all struck tags"),
        ("2 * 3 = 6, a - b", "2 * 3 = 6, a - b"),
        ("1. first\n2) second\n> quoted\n##", "first second quoted"),
        ("```python\nprint(1)\n```", "print(1)"),
        ("![diagram](a.png) shows it", "diagram shows it"),
    ],
)
def test_plain_text_drops_markdown_and_keeps_words(markdown: str, plain: str) -> None:
    assert plain_text(markdown) == plain


def test_final_title_is_plain_from_the_model_or_the_prompt() -> None:
    assert final_title('"**Parser** fix."', "", 8) == "Parser fix"
    assert (
        final_title("", "**hello** from the\n- browser\n- item one", 4) == "hello from the browser"
    )
    assert final_title("", "```\n```", 8) == DEFAULT_TITLE
