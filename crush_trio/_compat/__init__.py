"""Adapters to the private internals of dependencies, one module per library.

The rule: no module of ``crush_trio`` touches a private name of a dependency (a module, class,
function or attribute whose name starts with ``_``, such as ``from httpcore._async import ...``
or ``connection._h11_state``) except the one adapter module of that library here. Each adapter
says which versions of its library it was checked against, those versions are pinned exactly
in ``pyproject.toml``, and each checks its assumptions when imported, raising a clear error
that names what changed rather than degrading silently. ``tests/test_compat.py`` checks the
rule over the source tree.

* :mod:`crush_trio._compat.hypercorn`: ``hypercorn``'s per-connection reader and closer, for the
  listener's connection rules (:mod:`crush_trio.server.listener`), and the extension class of
  its websocket handshake (:mod:`crush_trio.wsdeflate`).
* :mod:`crush_trio._compat.trio_websocket`: ``trio-websocket``'s connection with permessage-deflate
  offered, accepted and bounded, for the event websocket's server
  (:mod:`crush_trio.server.ws_trio`) and client (:mod:`crush_trio.client.transport`).
"""


class CompatError(RuntimeError):
    """An installed dependency no longer has the internal shape its adapter relies on (the
    message names what changed, the installed versions and the versions checked)."""
