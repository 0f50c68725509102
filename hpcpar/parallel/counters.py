"""Per-process communication/I-O counters that layers accumulate and the training loop reads.

Layers add to the counters as they work (halo time and bytes, allreduce time and bytes, bytes
read); the training loop takes a :meth:`Counters.snapshot` at each step boundary and records
the difference. One instance per process (``COUNTERS``): counters are per-rank facts, not
communicator state.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

__all__ = ["Counters", "COUNTERS", "profiled"]


def profiled(name: str):
    """Show every call of the decorated function as a range ``name`` in torch.profiler traces
    (``[profile] steps``), and as an NVTX range under ``torch.autograd.profiler.emit_nvtx()``
    (Nsight Systems on CUDA). The communication of every layer is named this one way.
    Outside a profiler the range is skipped: opening one costs ~10 us, and a U-Net step
    makes a few dozen of these calls."""
    def deco(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            import torch  # loaded already by any caller; kept out of this module's import

            if not torch.autograd._profiler_enabled():
                return fn(*args, **kwargs)
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)
        return inner
    return deco


@dataclass
class Counters:
    """Per-process communication and I/O totals; read differences with ``snapshot``/``since``.

    Attributes:
        t_halo: Seconds spent in halo exchanges (forward + backward).
        t_halo_wait: The communication part of ``t_halo`` + ``t_graph_halo``: waiting for
            neighbours' messages, and the graph all-to-all.
        bytes_halo: Bytes sent in halo exchanges.
        t_allreduce_total: Seconds from the first bucket launch to the last bucket done.
        t_allreduce_exposed: Seconds the step waited for the gradient sync.
        bytes_allreduce: Gradient bytes reduced (as sent on the wire).
        t_graph_halo: Seconds in graph (GNN) halo exchanges.
        bytes_read: Bytes read from storage by this rank's reader.
        recompute_msgs: Messages sent while recomputing checkpointed segments
            (:mod:`hpcpar.parallel.replay`; 0 when the forward's faces were reused).
        recompute_bytes: Bytes of those messages.
    """

    t_halo: float = 0.0            # seconds spent in halo exchanges (forward + backward)
    t_halo_wait: float = 0.0       # the part of t_halo waiting for neighbours' messages
    bytes_halo: int = 0            # bytes sent in halo exchanges
    t_allreduce_total: float = 0.0  # seconds from first bucket launch to last bucket done
    t_allreduce_exposed: float = 0.0  # seconds the step waited for gradient sync
    bytes_allreduce: int = 0       # gradient bytes reduced (as sent on the wire)
    t_graph_halo: float = 0.0      # seconds in graph (GNN) halo exchanges
    bytes_read: int = 0            # bytes read from storage by this rank's reader
    recompute_msgs: int = 0        # messages sent while recomputing checkpointed segments
    recompute_bytes: int = 0       # their bytes

    def snapshot(self) -> Counters:
        """A copy of the current totals."""
        return Counters(**asdict(self))

    def since(self, earlier: Counters) -> dict:
        """Counter name -> difference since an earlier ``snapshot()`` (the per-step record
        fields)."""
        return {f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)}

    def reset(self) -> None:
        """Set every counter back to zero."""
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the seconds spent inside the ``with`` block to counter ``name``.

        Example:
            ```python
            with COUNTERS.timed("t_halo"):
                exchange()
            ```
        """
        t0 = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, name, getattr(self, name) + time.perf_counter() - t0)


COUNTERS = Counters()
