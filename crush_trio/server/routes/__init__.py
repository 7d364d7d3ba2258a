"""The HTTP routes of the application, one module per resource.

Every module has one ``register(app, ctx)`` that adds its handlers to the app; the handlers read
what they need from the :class:`~.context.RouteContext` they were given, never from the scope of
the function that built the app. :func:`crush_trio.server.app.create_app` calls them in turn:

- :mod:`.hooks`: the token, origin and host checks before every request, the access log after it,
  and the error table (every error is ``{"message": ...}`` with its status);
- :mod:`.changes`: diffs, reverts, forks, run lists and exports (:class:`~..history.History`);
- :mod:`.system`: health, version, the OpenAPI document and page, metrics, control, clients;
- :mod:`.workspaces`: opening, listing and releasing workspaces, the current session, trust;
- :mod:`.models`: the configuration, the provider catalog and model choice;
- :mod:`.sessions`: sessions and their messages;
- :mod:`.agent`: the agent's state, prompts, cancel, summaries and the prompt queue;
- :mod:`.runs`: one run, and cancelling it;
- :mod:`.permissions`: permission requests and their answers;
- :mod:`.events`: the event streams (SSE and the websocket route) and the test-only hooks;
- :mod:`.web`: the browser client's page and files.
"""
