"""The HTTP shell: routes, event streams (websocket and SSE), the connection dispatcher and serving.

Modules, from the outside in: :mod:`.serve` (listening socket, staged shutdown), :mod:`.listener`
(per-connection dispatcher in front of hypercorn), :mod:`.app` (``/v1`` routes), :mod:`.ws_trio` and
:mod:`.ws_asgi` (the two websocket transports), :mod:`.sse`, :mod:`.connection` (one event-stream
lifecycle every transport drives), :mod:`.commands` (websocket commands), :mod:`.api` (operations
shared by routes and commands), :mod:`.security` (token, origin, host and request checks) and
:mod:`.settings`.
"""
