"""The built-in ``echo`` provider: offline, deterministic, free.

It streams the text of the last user message back word by word, so the server works without any
model configured and load benchmarks need no LLM. It never calls tools.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final

import trio

from ..wire import FinishReason, Message, Role
from .base import Finished, ModelRequest, StreamEvent, TextDelta, Usage

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

#: A word with the whitespace around it; leading whitespace goes with the first word.
_WORD: Final = re.compile(r"\s*\S+\s*")


def split_words(text: str) -> list[str]:
    """Split ``text`` into words that keep their whitespace: ``"".join(result) == text``."""
    words = _WORD.findall(text)
    if not words and text:
        return [text]  # whitespace only
    return words


def count_words(text: str) -> int:
    return len(text.split())


def last_user_text(messages: list[Message]) -> str:
    """The text of the last user message, or ``""`` when there is none."""
    for message in reversed(messages):
        if message.role is Role.USER:
            return message.text()
    return ""


class EchoProvider:
    """Streams the last user message back word by word.

    Args:
        name: the provider's name in ``crush.json``.
        delay_ms: pause between words, in milliseconds (Trio's clock); 0 streams at once.

    Usage counts words: ``prompt_tokens`` is the number of words in the system prompt and the
    whole history, ``completion_tokens`` the number of words echoed.

    Cancellation: every word is preceded by a checkpoint (the sleep, or a bare checkpoint when
    there is no delay), so cancelling stops the stream before the next word.
    """

    type: str = "echo"

    def __init__(self, name: str = "echo", delay_ms: float = 0.0) -> None:
        self.name = name
        self.delay_ms = delay_ms

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamEvent]:
        """Yield the last user message's words, then Usage and ``Finished(END_TURN)``."""
        words = split_words(last_user_text(request.messages))
        delay = self.delay_ms / 1000
        for index, word in enumerate(words):
            if delay > 0 and index > 0:
                await trio.sleep(delay)
            else:
                await trio.lowlevel.checkpoint()
            yield TextDelta(word)
        prompt = count_words(request.system) + sum(count_words(m.text()) for m in request.messages)
        yield Usage(prompt_tokens=prompt, completion_tokens=count_words("".join(words)))
        yield Finished(FinishReason.END_TURN)

    async def aclose(self) -> None:
        """Nothing to release."""
