"""Per-process communication/I-O counters that layers accumulate and the training loop reads.

Layers add to the counters as they work (halo time and bytes, allreduce time and bytes, bytes
read); the training loop takes a :meth:`Counters.snapshot` at each step boundary and records
the difference. One instance per process (``COUNTERS``): counters are per-rank facts, not
communicator state.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields


@dataclass
class Counters:
    t_halo: float = 0.0            # seconds spent in halo exchanges (forward + backward)
    t_halo_wait: float = 0.0       # the part of t_halo waiting for neighbours' messages
    bytes_halo: int = 0            # bytes sent in halo exchanges
    t_allreduce_total: float = 0.0  # seconds from first bucket launch to last bucket done
    t_allreduce_exposed: float = 0.0  # seconds the step waited for gradient sync
    bytes_allreduce: int = 0       # gradient bytes reduced (as sent on the wire)
    t_graph_halo: float = 0.0      # seconds in graph (GNN) halo exchanges
    bytes_read: int = 0            # bytes read from storage by this rank's reader

    def snapshot(self) -> "Counters":
        return Counters(**asdict(self))

    def since(self, earlier: "Counters") -> dict:
        """Differences since ``earlier`` as a dict (the per-step record fields)."""
        return {f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)}

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())

    @contextmanager
    def timed(self, name: str):
        """``with COUNTERS.timed("t_halo"): ...`` adds the elapsed seconds to ``name``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, name, getattr(self, name) + time.perf_counter() - t0)


COUNTERS = Counters()
