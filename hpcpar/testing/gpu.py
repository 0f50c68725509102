"""GPU tests: the ``gpu`` pytest marker's skip rule, shared by tests/gpu/ and the device check.

A GPU test module starts with ``pytestmark = requires_gpu()``: it is marked ``gpu`` (select the GPU
tests with ``pytest -m gpu``) and skipped, with the reason, where no CUDA device is visible, before
any ``mpiexec`` is launched. Inside an MPI case, :func:`skip_without_gpu` gives the same skip on
every rank."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["gpu_skip_reason", "requires_gpu", "skip_without_gpu", "busy_stream"]


def gpu_skip_reason() -> str | None:
    """Why GPU tests cannot run here in one line (torch built without CUDA, no device visible,
    ``CUDA_VISIBLE_DEVICES``), or None when a CUDA device is visible."""
    import torch

    if torch.version.cuda is None:
        return f"no CUDA device: torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        return "no CUDA device visible" + (f" (CUDA_VISIBLE_DEVICES={hidden!r})"
                                           if hidden is not None else "")
    return None


def requires_gpu() -> list:
    """The marks of a GPU test module's ``pytestmark``: ``[pytest.mark.gpu,
    pytest.mark.skipif(...)]``, skipping with the reason without a device."""
    import pytest

    reason = gpu_skip_reason()
    return [pytest.mark.gpu, pytest.mark.skipif(reason is not None, reason=reason or "")]


def skip_without_gpu() -> None:
    """Inside a test (or an MPI case, on every rank alike): skip without a CUDA device."""
    import pytest

    reason = gpu_skip_reason()
    if reason is not None:
        pytest.skip(reason)


def busy_stream(seconds: float = 0.05) -> torch.cuda.Stream:
    """A new CUDA stream with a kernel that spins about ``seconds`` queued on it: work queued after
    it on that stream is still pending when the host moves on (stream-safety tests)."""
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(seconds * 1.5e9))  # cycles, at a ~1.5 GHz clock
    return stream
