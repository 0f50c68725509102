"""``[profile] steps = "20-24"``: a torch.profiler window over a few training steps, one Chrome
trace per rank (``RUN/profile/rank-00000.json``; open in chrome://tracing or Perfetto).

Communication shows as named ranges: ``hpcpar.halo_exchange`` and
``hpcpar.halo_exchange.backward`` (spatial layers), ``hpcpar.graph_halo`` and
``hpcpar.graph_halo.backward`` (GNN layers), ``hpcpar.allreduce.launch`` (a gradient bucket
handed to MPI during backward) and ``hpcpar.allreduce`` (the end of backward: the wait for the
last buckets, the exposed sync). Under ``torch.autograd.profiler.emit_nvtx()`` they are NVTX
ranges too (Nsight Systems). :func:`named_range` names your own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["ProfileWindow", "named_range"]


@contextlib.contextmanager
def named_range(name: str, cuda: bool = False) -> Iterator[None]:
    """A range named ``name`` over the ``with`` body in torch.profiler traces (and an NVTX range
    for Nsight Systems when ``cuda``)."""
    import torch

    with torch.profiler.record_function(name):
        if cuda:
            torch.cuda.nvtx.range_push(name)
            try:
                yield
            finally:
                torch.cuda.nvtx.range_pop()
        else:
            yield


class ProfileWindow:
    """Profiles steps ``window = (first, last)`` (1-based, inclusive; None: none) of this rank
    into ``out_dir`` (``RUN/profile``); ``device_type`` ``"cuda"`` adds CUDA activity,
    ``record_shapes`` operator input shapes, ``memory`` memory allocations."""

    def __init__(self, window: tuple[int, int] | None, out_dir: str | Path, rank: int,
                 device_type: str = "cpu", record_shapes: bool = False, memory: bool = False):
        self.window, self.out_dir, self.rank = window, Path(out_dir), rank
        self.device_type, self.record_shapes, self.memory = device_type, record_shapes, memory
        self.prof: torch.profiler.profile | None = None
        self.trace: Path | None = None

    def before_step(self, step: int) -> None:
        """Start profiling when ``step`` (1-based, about to run) opens the window."""
        if self.window is None or self.prof is not None or not (
                self.window[0] <= step <= self.window[1]):
            return
        import torch

        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=acts, record_shapes=self.record_shapes,
                                           profile_memory=self.memory)
        self.prof.start()

    def after_step(self, step: int) -> None:
        """Stop and write the trace when ``step`` (1-based, just done) closes the window."""
        if self.prof is not None and self.window is not None and step >= self.window[1]:
            self.close()

    def close(self) -> None:
        """Stop a running profile and write this rank's trace (a window cut short too)."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.trace = self.out_dir / f"rank-{self.rank:05d}.json"
        prof.export_chrome_trace(str(self.trace))
