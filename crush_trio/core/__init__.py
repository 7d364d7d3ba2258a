"""The kernel: the vocabulary every layer speaks and the plain-logic cores. No I/O and no event
loop (it imports only ``wire``, ``errors`` and ``defaults``: docs/architecture.md, checked in CI).

Vocabulary:

* :mod:`.model` — what the agent asks a model provider and what the provider answers;
* :mod:`.ports` — what the agent and the backend need from the adapters (store, message store,
  event log, terminal records, change hooks), as protocols;
* :mod:`.placement` — which node serves a workspace, and :class:`~.placement.LocalPlacement`,
  the single server's answer.

Plain-logic cores, each tested as a table of moves:

* :mod:`.agent_state` — accept sequence, busy, queue, folding and cancel of every session;
* :mod:`.assembler` — provider events folded into a step's assistant message;
* :mod:`.holds` — client holds on a workspace and their deadlines;
* :mod:`.lifecycle` — the workspace state table.

The run status table is :data:`crush_trio.wire.RUN_TRANSITIONS` (a wire type's rules).
"""
