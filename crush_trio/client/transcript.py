"""Printing a run's reply as it streams, without losing or repeating text (plain logic, no I/O).

A run's assistant text reaches a client twice: as ``message`` and ``message_delta`` events while
it streams (lossy: some may be dropped; the client's event stream assembles each delta into the
whole message so far, :attr:`Event.message <crush_trio.client.Event.message>`) and as
``run_complete.text`` at the end (authoritative: the full text of the turn's last assistant
message). :class:`Transcript`
reconciles the two with one cursor per message, the way ``crush run`` does:

* :meth:`Transcript.update` takes a message (a snapshot, or the message a delta leads to) and
  returns only the text not printed yet: for a delta, its appended text.
  An older snapshot (arriving after a newer one, e.g. from a refetch) prints nothing.
* :meth:`Transcript.finish` takes the ``run_complete`` and returns the rest of the final message,
  so the output ends with exactly its text whatever was dropped on the way.

A turn that runs tools has one assistant message per model step; their texts are printed in
order, separated by a newline. When a message's text stops extending what was printed (a
provider retry restarts the reply), streaming of that message stops and :meth:`finish` prints the
final text on a new line: text already on a terminal cannot be taken back.
"""

from __future__ import annotations

import attrs

from ..wire import Message, Role


@attrs.define
class Transcript:
    """The printed text of one run, per assistant message (see the module docstring)."""

    #: Text printed so far for each assistant message id, in the order the messages appeared.
    printed: dict[str, str] = attrs.field(factory=dict)
    #: Message ids whose text stopped extending what was printed (no more streaming for them).
    diverged: set[str] = attrs.field(factory=set)
    #: Everything returned so far, i.e. what the caller has printed.
    output: str = ""

    def _emit(self, message_id: str, text: str) -> str:
        if not text:
            return ""
        out = text
        if not self.printed[message_id] and self.output and not self.output.endswith("\n"):
            out = "\n" + text  # a new step's text starts on its own line
        self.printed[message_id] += text
        self.output += out
        return out

    def update(self, message: Message) -> str:
        """Text of ``message`` not printed yet ('' for other roles, summaries, stale or diverged
        snapshots)."""
        if message.role is not Role.ASSISTANT or message.is_summary_message:
            return ""  # a summary is bookkeeping, not part of the reply
        mid = message.id
        text = message.text()
        if mid not in self.printed:
            self.printed[mid] = ""
        if mid in self.diverged:
            return ""
        done = self.printed[mid]
        if text.startswith(done):
            return self._emit(mid, text[len(done) :])
        if done.startswith(text):
            return ""  # an older snapshot than one already printed
        self.diverged.add(mid)
        return ""

    def finish(self, message_id: str | None, text: str) -> str:
        """The rest of the final reply (``run_complete.message_id`` and ``.text``) to print."""
        if not text:
            return ""
        if message_id is None:
            message_id = ""
        done = self.printed.setdefault(message_id, "")
        if message_id not in self.diverged and text.startswith(done):
            return self._emit(message_id, text[len(done) :])
        out = "\n" + text if self.output and not self.output.endswith("\n") else text
        self.printed[message_id] = text
        self.output += out
        return out
