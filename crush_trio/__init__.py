"""crush_trio: a headless server for AI coding-agent sessions, built on Trio.

Layers, from the wire inwards (one module or package each; docs/architecture.md draws them and
states the import rules that CI checks):

* ``wire`` — attrs wire types and the one cattrs converter; ``errors`` — the error hierarchy.
* ``config`` — Crush's ``crush.json`` subset.
* ``store`` — SQLite per workspace (worker thread), the row shape both SQL stores share, and
  the debounced message buffer.
* ``broker`` — sequencing, encode-once, replay, per-client bounded delivery.
* ``core`` — the kernel, without Trio or I/O: the model types, the ports the adapters keep
  (store, event log, placement...), and the plain logic: run bookkeeping, the step assembler,
  holds, lifecycle.
* ``agent`` — the turn runner shell, the tool step, titles and run records.
* ``providers`` — echo, OpenAI-compatible and Anthropic streaming models.
* ``tools`` — the agent's coding tools; ``permissions`` — who may run them.
* ``backend`` — workspaces, client holds and the registry that owns their nurseries.
* ``server`` — HTTP, SSE and websocket transports (quart-trio on hypercorn) and ``serve``.
* ``client`` — the Trio client library (it never imports ``server``).
* ``embedded`` — a server in this process and a client of it (above ``server`` and ``client``).
* ``cli`` — ``crush-trio serve`` and ``crush-trio run``.
* ``_compat`` — the one adapter per dependency allowed to touch its private internals, each
  checked at import against the pinned versions.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
