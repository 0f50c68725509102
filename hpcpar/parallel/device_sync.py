"""Every wait of the host for device work goes through here, so it can be counted.

A message must wait only for the work that wrote its bytes: the pack, queued on the current
stream. :func:`after_current_work` records an event on the current stream and waits for that
event (later work, other streams and other processes' kernels keep running);
:func:`producer_stream` waits for a named producer stream; :func:`whole_device` waits for
every stream of the device and is kept out of a step's messages (a step's boundary may use
it, to time the step). :data:`COUNTS` counts each kind of wait, on CPU tensors too (where the
wait itself is nothing), so a CPU test sees exactly the waits a GPU step would make.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

import torch

__all__ = ["COUNTS", "Synchronizable", "after_current_work", "producer_stream", "whole_device"]

#: waits made so far, by kind: "event" (current stream, up to now), "stream" (a named
#: producer), "device" (every stream of the device)
COUNTS: Counter = Counter()


class Synchronizable(Protocol):
    """A producer ``stream`` argument: anything that can wait for its work (a
    ``torch.cuda.Stream``, an event)."""

    def synchronize(self) -> None: ...


def after_current_work(device: torch.device) -> None:
    """Block until the work queued so far on ``device``'s current stream is done (an event
    recorded now, waited for): what MPI or a host copy needs before it reads a face packed on
    that stream, or writes a buffer queued work may still read."""
    COUNTS["event"] += 1
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        event.synchronize()


def producer_stream(stream: Synchronizable) -> None:
    """Block until the named producer (a stream or an event) is done."""
    COUNTS["stream"] += 1
    stream.synchronize()


def whole_device(device: torch.device) -> None:
    """Block until every stream of ``device`` is idle: a step boundary only, never a
    message (a test counts these in a step)."""
    COUNTS["device"] += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
