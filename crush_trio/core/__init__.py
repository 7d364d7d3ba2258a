"""Plain-logic cores: no I/O and no event loop, so each is tested as a table of moves.

* :mod:`.agent_state` — accept sequence, busy, queue, folding and cancel of every session;
* :mod:`.assembler` — provider events folded into a step's assistant message;
* :mod:`.holds` — client holds on a workspace and their deadlines;
* :mod:`.lifecycle` — the workspace state table.

The run status table is :data:`crush_trio.wire.RUN_TRANSITIONS` (a wire type's rules).
"""
