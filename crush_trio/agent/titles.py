"""Session titles: the small model names a new session after its first prompt.

Runs in the workspace's background nursery, bounded by :data:`TITLE_TIMEOUT`; whatever happens
(model failure, timeout, cancel) some title is saved in a shielded, time-bounded scope: the
model's, else the prompt's first words, cut to ``options.title_max_words``. A title the client
already gave the session is kept, and then no model call is made.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import TYPE_CHECKING, Final

import trio

from ..core import model as pb
from ..wire import EventKind, Message, Role, TextPart, new_id

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..broker import Broker
    from ..config import Config
    from ..core.ports import WorkspaceStore
    from .provider_cache import ProviderCache

log = logging.getLogger(__name__)

#: Bound on the title request to the small model (seconds).
TITLE_TIMEOUT: Final = 30.0
DEFAULT_TITLE: Final = "Untitled Session"
TITLE_PROMPT: Final = (
    "Write a short title (at most eight words, no quotes, no trailing punctuation) for a "
    "conversation that starts with the user's message."
)
#: Bound on the tokens of the title request.
TITLE_MAX_TOKENS: Final = 64


#: Markdown that a title shows as plain text: images and links keep their text, code fences and
#: HTML tags go, and so do the markers of headings, quotes, list items and emphasis.
_MD_LINK: Final = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_MD_FENCE: Final = re.compile(r"^\s*(```|~~~).*$", re.MULTILINE)
_MD_TAG: Final = re.compile(r"</?[A-Za-z][^>]*>")
_MD_LINE_MARK: Final = re.compile(
    r"^[ \t]*(?:#{1,6}(?:[ \t]+|$)|>[ \t]*|[-*+](?:[ \t]+|$)|\d+[.)][ \t]+)", re.MULTILINE
)
_MD_EMPHASIS: Final = re.compile(r"(\*{1,3}|~~|`+)(?=\S)(.+?)(?<=\S)\1")
#: Underscores mark emphasis only outside a word (``snake_case`` stays as it is).
_MD_UNDERSCORE: Final = re.compile(r"(?<!\w)(_{1,3})(?=\S)(.+?)(?<=\S)\1(?!\w)")


def plain_text(markdown: str) -> str:
    """``markdown`` as the plain words a reader sees, on one line (for a title)."""
    text = _MD_FENCE.sub(" ", markdown)
    text = _MD_LINK.sub(r"\1", text)
    text = _MD_TAG.sub(" ", text)
    text = _MD_LINE_MARK.sub(" ", text)
    for _ in range(3):  # nested emphasis, e.g. ***a*** or **`code`**
        text = _MD_UNDERSCORE.sub(r"\2", _MD_EMPHASIS.sub(r"\2", text))
    return " ".join(text.split())


def clean_title(text: str) -> str:
    """A model's title as plain text, without surrounding quotes and trailing punctuation."""
    return plain_text(text).strip("\"'").strip().rstrip(".!?:;")


def fallback_title(prompt: str, max_words: int) -> str:
    """The title used when the model gives none: the prompt's first ``max_words`` words."""
    return " ".join(plain_text(prompt).split()[:max_words])


def final_title(model_title: str, prompt: str, max_words: int) -> str:
    """The title saved: the model's (cleaned), else the prompt's first words, cut to
    ``max_words`` words; :data:`DEFAULT_TITLE` when both are empty."""
    title = clean_title(model_title) or fallback_title(prompt, max_words)
    return " ".join(title.split()[:max_words]) or DEFAULT_TITLE


class Titles:
    """Titles the sessions of one workspace.

    Args:
        providers: the workspace's providers (a title holds one while it asks the model).
        is_busy: whether a session has a turn running (published with the titled session).
        save_timeout: bound on the shielded save of the title (seconds).
    """

    def __init__(
        self,
        *,
        store: WorkspaceStore,
        broker: Broker,
        config: Config,
        providers: ProviderCache,
        is_busy: Callable[[str], bool],
        save_timeout: float,
    ) -> None:
        self.store = store
        self.broker = broker
        self.config = config
        self._providers = providers
        self._is_busy = is_busy
        self.save_timeout = save_timeout

    async def generate(self, session_id: str, prompt: str) -> None:
        """Title a new session with the small model; always saves some title (a title the
        client already gave the session is kept, and no model call is made)."""
        session = await self.store.get_session(session_id)
        if session is None or session.title:
            return
        title: list[str] = []  # what the model streamed, kept when it fails or times out midway
        try:
            with trio.move_on_after(TITLE_TIMEOUT):
                await self._ask_model(session_id, prompt, title)
        except trio.Cancelled:
            raise
        except Exception as exc:
            log.warning("title generation for session %s failed: %s", session_id, exc)
        finally:
            with trio.move_on_after(self.save_timeout, shield=True):
                await self._save(session_id, "".join(title), prompt)

    async def _ask_model(self, session_id: str, prompt: str, title: list[str]) -> None:
        name, cfg, entry = self.config.resolve_model("small")
        provider = self._providers.acquire(name, cfg)
        try:
            request = pb.ModelRequest(
                model=pb.ModelInfo(entry.id, entry.name, entry.context_window, TITLE_MAX_TOKENS),
                system=TITLE_PROMPT,
                messages=[Message(new_id(), session_id, Role.USER, [TextPart(prompt)])],
                max_tokens=TITLE_MAX_TOKENS,
                purpose=pb.RequestPurpose.TITLE,
            )
            stream = provider.stream(request)
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for event in stream:
                    if isinstance(event, pb.TextDelta):
                        title.append(event.text)
        finally:
            self._providers.release(provider)

    async def _save(self, session_id: str, model_title: str, prompt: str) -> None:
        title = final_title(model_title, prompt, self.config.options.title_max_words)
        # The title alone: a whole-session write would undo the usage a step recorded meanwhile.
        session = await self.store.set_title(session_id, title, keep_existing=True)
        if session is None or session.title != title:
            return  # gone, or the client titled it meanwhile
        session.is_busy = self._is_busy(session_id)
        self.broker.publish(session, EventKind.UPDATED)
