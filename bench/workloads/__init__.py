"""The workloads (W1-W7), run by the orchestrator process.

Each workload starts a fresh server (``python -m crush_trio serve``) per measured configuration,
drives it from client worker processes (:mod:`bench.client`), reads the server's CPU time and
memory from ``/proc``, and returns a :class:`~bench.report.WorkloadResult` with its tables,
targets and chart.

* :mod:`.sizes`: every size, with the :data:`FULL` and :data:`SMOKE` presets.
* :mod:`.common`: the context every workload gets (:class:`Ctx`) and the building blocks: server
  configs, the fake model, the orchestrator's hold on a workspace, client worker processes.
* :mod:`.rounds`: rounds of concurrent one-prompt sessions (W1 and W2).
* :mod:`.w1` ... :mod:`.w7`: one workload each (W6, the long soak, runs at full size only when
  asked for: ``--only W6`` or ``--soak-minutes``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from .common import Ctx
from .sizes import FULL, SMOKE, Sizes
from .w1 import w1
from .w2 import w2
from .w3 import w3
from .w4 import w4
from .w5 import w5
from .w6 import w6
from .w7 import w7

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ..report import WorkloadResult

__all__ = ["DEFAULT_FULL", "FULL", "SMOKE", "WORKLOADS", "Ctx", "Sizes"]

WORKLOADS: Final[dict[str, Callable[[Ctx], Awaitable[WorkloadResult]]]] = {
    "W1": w1,
    "W2": w2,
    "W3": w3,
    "W4": w4,
    "W5": w5,
    "W6": w6,
    "W7": w7,
}
#: Workloads of a full run when none are named (the soak takes an hour: asked for by name).
DEFAULT_FULL: Final = ["W1", "W2", "W3", "W4", "W5", "W7"]
