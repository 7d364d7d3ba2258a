"""Load benchmarks of the crush_trio server: ``python -m bench [--smoke] [--only W1,W3]``.

Every workload drives a real server process over its public protocol from separate client
processes, through the project's own client library (:mod:`crush_trio.client`), with the model
played by a fake OpenAI-compatible server on loopback (:mod:`bench.fake`) or the built-in echo
model. Server CPU time and memory come from ``/proc/<pid>``. Layout:

* :mod:`bench.__main__`: the command line; runs the workloads, prints and writes the results.
* :mod:`bench.workloads`: W1 throughput, W2 latency, W3 fan-out, W4 memory, W5 chaos (one
  module each, on the building blocks of :mod:`bench.workloads.common`).
* :mod:`bench.client`: the client worker processes (load generators) and why some of them
  read raw frames.
* :mod:`bench.procs`: child processes, the JSON-line protocol with them, ``/proc`` readings.
* :mod:`bench.fake`, :mod:`bench.bare`: the fake model and the bare websocket ceiling.
* :mod:`bench.report`, :mod:`bench.charts`: Markdown tables, targets, PNG charts.

See ``docs/performance.md`` for the figures and how to read them.
"""
