"""The roles of the client workers (see :mod:`bench.client`), one module per kind of client."""
