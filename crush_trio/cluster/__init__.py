"""Several nodes sharing PostgreSQL and Redis: leases, the shared store and event log, placement.

Nothing here is imported in single-node mode; the modules import their database drivers lazily.
"""
