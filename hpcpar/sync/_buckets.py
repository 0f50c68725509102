"""Gradient buckets and their non-blocking reduction.

A :class:`Bucket` is one flat buffer holding the gradients of a few parameters (each
parameter's ``.grad`` is a view into it) followed by one "has a gradient" flag per parameter
and padding to a multiple of the group size. A :class:`ReduceGroup` reduces a bucket over
one communicator as a pipeline of non-blocking MPI steps (a generator that yields requests),
so the training thread can start it from a backward hook, nudge it forward from later hooks
and finish it at the end of backward:

* gather (small buckets, where latency dominates): one ``Iallgather`` of every rank's whole
  bucket, then every rank sums all rows in the canonical order -> divide;
* flat: ``Ialltoallv`` (rank r receives the others' chunk r) -> sum in the canonical order
  of :func:`hpcpar.sync._compression.fold` -> divide -> ``Iallgather``;
* shared (every rank on one node, full-precision CPU gradients): the buckets live in an MPI
  shared-memory window; rank r sums chunk r of every rank's bucket by direct loads, divides,
  then copies the other chunks from their owners, between three barriers (no message
  copies: 1.2-1.4x the bandwidth of a raw ``MPI_Allreduce`` for a 16 MB model on two ranks,
  vs 0.7-0.85x for the message path, measured by benchmarks/allreduce.py);
  ``HPCPAR_DDP_SHM=0`` turns it off;
* hierarchical (equal ranks per node, more than one node and one rank per node): the same
  two-step reduce-scatter first inside the node (shared memory), then between node peers
  (ranks with the same node-local index), then the two allgathers in reverse;
* torch.distributed (``grad_sync="nccl"``): :class:`TorchGroup`, one NCCL allreduce per
  bucket, bootstrapped from MPI by :mod:`hpcpar.sync._torchdist`.

All paths sum in the same order (nodes' ranks first, then nodes), so fp32 results are
bitwise identical with hierarchical on or off, and every rank gets the same bytes. Each
bucket runs on its own duplicated communicators (see :meth:`ReduceGroup.channel`).
"""

from __future__ import annotations

import os
import time

import torch

from hpcpar import _env
from hpcpar.parallel.buffers import as_buffer, free_at_exit, message_buffer
from hpcpar.sync._compression import accumulation_dtype, fold
from hpcpar.sync._torchdist import TorchWork, process_group
from hpcpar.sync.layout import shaped_like

MB = 1 << 20
#: buckets whose other ranks' copies total at most this many bytes take the one-round path
SMALL_BUCKET_BYTES = 256 * 1024
#: a synchronising stage still unfinished after SPIN_S plus SPIN_S_PER_BYTE of its bucket
#: (the time a peer takes to sum and copy its share) waits for a peer that is still computing
SPIN_S = 100e-6
SPIN_S_PER_BYTE = 1e-9
#: ... and sleeps between polls: NAP_FRACTION of the time waited so far, within
#: [NAP_S, MAX_NAP_S] (plus the kernel's timer slack), so it notices the peer at most ~5%
#: late and a long wait costs almost no CPU
NAP_S = 20e-6
MAX_NAP_S = 500e-6
NAP_FRACTION = 0.05
#: plans whose stages only synchronise (no large message needs both ranks polling)
NAPPING_PLANS = ("shared", "gather")


def _one_shared_node(comm) -> bool:
    """True when every rank of ``comm`` can map the others' memory (one node)."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size() == comm.Get_size()
    finally:
        node.Free()


class ReduceGroup:
    """Sum over ``comm`` then divide by ``divisor``; optionally node-hierarchical.

    Collective: every rank of ``comm`` constructs it with the same arguments.
    ``node_index`` is this rank's node (``ProcessGrid.node_index``).
    """

    def __init__(self, comm, node_index: int, divisor: int, hierarchical="auto"):
        self.comm = comm
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.divisor = divisor
        nodes = comm.allgather(int(node_index))
        order = sorted(set(nodes))
        #: the canonical summation order: comm ranks grouped by node, nodes in order
        self.groups = [[r for r, n in enumerate(nodes) if n == node] for node in order]
        counts = {len(g) for g in self.groups}
        possible = len(self.groups) > 1 and len(counts) == 1 and counts.pop() > 1
        wanted = possible if hierarchical == "auto" else bool(hierarchical)
        self.hierarchical = wanted and possible
        #: every rank of ``comm`` shares one node's memory: buckets can live in an MPI
        #: shared-memory window and be reduced by direct loads (see ``_shared``); agreed on
        #: by all ranks, so an environment that differs between ranks cannot split the plans
        self.shared = False
        if self.size > 1:
            from mpi4py import MPI

            wanted = (not self.hierarchical and len(self.groups) == 1
                      and _env.get("HPCPAR_DDP_SHM"))
            self.shared = bool(comm.allreduce(int(_one_shared_node(comm) and wanted),
                                              op=MPI.MIN))
        if self.hierarchical:
            node = order.index(int(node_index))
            local = self.groups[node].index(self.rank)
            self.node_comm = comm.Split(color=node, key=self.rank)
            self.peer_comm = comm.Split(color=local, key=node)
            self.local, self.node = local, node
            self.local_size, self.num_nodes = len(self.groups[0]), len(self.groups)

    def plan(self, wire_bytes: int, shareable: bool = False) -> str:
        """How a bucket of ``wire_bytes`` is reduced: ``"gather"`` for small buckets (one
        allgather of everything, then every rank folds all rows: one message round instead
        of two, latency wins), ``"shared"`` when all ranks share one node's memory and the
        bucket can live there (``shareable``: full-precision CPU gradients), else
        ``"hierarchical"`` or ``"flat"``."""
        if self.size == 1:
            return "local"
        if wire_bytes * (self.size - 1) <= SMALL_BUCKET_BYTES:
            return "gather"
        if self.hierarchical:
            return "hierarchical"
        return "shared" if self.shared and shareable else "flat"

    def shared_segments(self, numel: int, dtype: torch.dtype):
        """(window, [every rank's segment as a tensor], release) of a new shared-memory
        window of ``numel`` items per rank (collective; call in the same order everywhere).
        Kept in a passive-target epoch for ``Win.Sync``; freed by ``release()`` or at exit."""
        from mpi4py import MPI

        win = MPI.Win.Allocate_shared(numel * dtype.itemsize, dtype.itemsize, comm=self.comm)
        win.Lock_all(MPI.MODE_NOCHECK)
        def free() -> None:
            win.Unlock_all()
            win.Free()

        release = free_at_exit(free)
        segs = [torch.frombuffer(win.Shared_query(r)[0], dtype=dtype, count=numel)
                for r in range(self.size)]
        segs[self.rank].zero_()
        return win, segs, release

    def channel(self, plan: str) -> tuple:
        """Private communicators for one bucket (collective; call in the same order everywhere).

        MPI needs every rank to START collectives on a communicator in the same order. A
        bucket's stages start whenever this rank notices the previous stage finished, so two
        buckets' stages may interleave differently on different ranks: each bucket therefore
        reduces on its own duplicates, where its stages always come in the same order (and
        collectives of the model or the user on the grid's communicators cannot interleave).
        """
        if plan == "local":
            return ()
        if plan == "hierarchical":
            return (self.node_comm.Dup(), self.peer_comm.Dup())
        return (self.comm.Dup(),)  # "shared": its barriers

    def close(self) -> None:
        """Free the node and peer communicators of a hierarchical group (collective)."""
        if self.hierarchical:
            self.node_comm.Free()
            self.peer_comm.Free()
            self.hierarchical = False

    def reduce(self, bucket: Bucket):
        """Generator: yields MPI requests; when exhausted, ``bucket.flat`` holds the result."""
        if bucket.plan == "local":
            if self.divisor != 1:
                bucket.flat.div_(self.divisor)
            return
        if bucket.wire is not bucket.flat:
            bucket.wire.copy_(bucket.flat)
        if bucket.plan == "gather":
            yield from self._gather(bucket)
            return
        yield from getattr(self, "_" + bucket.plan)(bucket)
        if bucket.wire is not bucket.flat:
            bucket.flat.copy_(bucket.wire)

    def _gather(self, bucket):
        (comm,) = bucket.channel
        rows = bucket.scratch("gather.recv", (self.size, bucket.wire.numel()), bucket.wire.dtype)
        send_buf = as_buffer(bucket.wire, copy_back=False)
        recv_buf = as_buffer(rows)
        yield comm.Iallgather(send_buf.mpi, recv_buf.mpi)
        send_buf.finish()
        recv_buf.finish()
        out = bucket.flat if bucket.flat.dtype == bucket.acc_dtype else \
            bucket.scratch("gather.out", (bucket.flat.numel(),), bucket.acc_dtype)
        fold(rows, self.groups, out, lambda: bucket.scratch("gather.tmp", out.shape, out.dtype))
        if self.divisor != 1:
            out.div_(self.divisor)
        if out is not bucket.flat:
            bucket.flat.copy_(out)

    def _shared(self, bucket):
        """Every rank's bucket is in one shared-memory window: rank r sums chunk r of all
        of them by direct loads (canonical order), divides, and then copies the other
        chunks from their owners. Three barriers, no message copies: about a third of the
        memory traffic of reduce-scatter + allgather through MPI."""
        (comm,) = bucket.channel
        win, segs = bucket.window, bucket.segments
        r, size = self.rank, self.size
        chunk = bucket.flat.numel() // size
        win.Sync()
        yield comm.Ibarrier()  # every rank's gradients are in its segment
        win.Sync()
        rows = [seg[r * chunk:(r + 1) * chunk] for seg in segs]
        fold(rows, self.groups, rows[r],
             lambda: bucket.scratch("shared.tmp", (chunk,), bucket.flat.dtype))
        if self.divisor != 1:
            rows[r].div_(self.divisor)
        win.Sync()
        yield comm.Ibarrier()  # every chunk is reduced
        win.Sync()
        for q in range(0 if bucket.scatter_only else size):
            if q != r:
                bucket.flat[q * chunk:(q + 1) * chunk].copy_(segs[q][q * chunk:(q + 1) * chunk])
        win.Sync()
        yield comm.Ibarrier()  # nobody reads this rank's segment any more

    def _flat(self, bucket):
        (comm,) = bucket.channel
        yield from _reduce_scatter(comm, bucket.wire, self.groups, self.divisor, bucket, "flat")
        if not bucket.scatter_only:
            yield from _allgather_in_place(comm, bucket.wire)

    def _hierarchical(self, bucket):
        node_comm, peer_comm = bucket.channel
        wire = bucket.wire
        part = wire.numel() // self.local_size
        mine = wire[self.local * part:(self.local + 1) * part]
        # inside the node: this rank ends with chunk `local` summed over the node (no divide)
        yield from _reduce_scatter(node_comm, wire, [list(range(self.local_size))], 1,
                                   bucket, "node")
        # between nodes: node partials summed in node order, then divided
        yield from _reduce_scatter(peer_comm, mine,
                                   [[n] for n in range(self.num_nodes)], self.divisor,
                                   bucket, "peer")
        yield from _allgather_in_place(peer_comm, mine)
        yield from _allgather_in_place(node_comm, wire)


def _reduce_scatter(comm, wire: torch.Tensor, groups, divisor: int, bucket, key: str):
    """Leave in chunk ``rank`` of ``wire`` the canonical sum over ``comm`` (divided).

    The other ranks' copies of my chunk arrive in ``recv``; my own is read in place."""
    size, rank = comm.Get_size(), comm.Get_rank()
    chunk = wire.numel() // size
    acc_dtype = bucket.acc_dtype
    recv = bucket.scratch(key + ".recv", (size, chunk), wire.dtype)
    counts = [0 if r == rank else chunk for r in range(size)]
    displs = [r * chunk for r in range(size)]
    send_buf = as_buffer(wire, copy_back=False)
    recv_buf = as_buffer(recv)
    yield comm.Ialltoallv([send_buf.mpi, (counts, displs)], [recv_buf.mpi, (counts, displs)])
    send_buf.finish()
    recv_buf.finish()
    mine = wire[rank * chunk:(rank + 1) * chunk]
    rows = [mine if r == rank else recv[r] for r in range(size)]
    simple = len(groups) == 1 or all(len(g) == 1 for g in groups)
    in_place = wire.dtype == acc_dtype and simple
    out = mine if in_place else bucket.scratch(key + ".out", (chunk,), acc_dtype)
    fold(rows, groups, out, lambda: bucket.scratch(key + ".tmp", (chunk,), acc_dtype))
    if divisor != 1:
        out.div_(divisor)
    if out is not mine:
        mine.copy_(out)


def _allgather_in_place(comm, wire: torch.Tensor):
    from mpi4py import MPI

    buf = as_buffer(wire)
    yield comm.Iallgather(MPI.IN_PLACE, buf.mpi)
    buf.finish()


class TorchGroup:
    """Sum over a torch.distributed process group (NCCL on GPUs) then divide by ``divisor``:
    the same buckets, launch order and overlap as :class:`ReduceGroup`, one ``allreduce``
    per bucket (NCCL picks its own algorithm; with 2 ranks the sum is bitwise the MPI one).

    Collective: every rank of ``comm`` constructs it (the group is bootstrapped over MPI by
    :func:`hpcpar.sync._torchdist.process_group`).
    """

    hierarchical = False
    shared = False

    def __init__(self, comm, divisor: int, backend: str, device=None):
        self.comm = comm
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.divisor = divisor
        self.backend = backend
        self.pg, self._store, self._release = process_group(comm, backend, device)

    def plan(self, wire_bytes: int, shareable: bool = False) -> str:
        """Always the group's allreduce (also on one rank: the path is the one tested)."""
        return self.backend

    def channel(self, plan: str) -> tuple:
        """No private communicators: a process group runs its collectives in issue order."""
        return ()

    def close(self) -> None:
        """Shut the process group down (collective)."""
        self._release()

    def reduce(self, bucket: Bucket):
        """Generator: yields one work item; when exhausted, ``bucket.flat`` holds the result."""
        wire = bucket.wire
        if wire is not bucket.flat:
            wire.copy_(bucket.flat)
        yield TorchWork(self.pg.allreduce([wire]))
        if wire is not bucket.flat:
            bucket.flat.copy_(wire)
        if self.divisor != 1:
            bucket.flat.div_(self.divisor)


class Pending:
    """Drives a reduction generator: ``test()`` advances without blocking, ``wait()`` finishes.

    ``spin_s``: set when the pipeline's stages only synchronise (barriers, small messages):
    a rank still waiting on a stage after ``spin_s`` is waiting for a peer that is still
    computing, so it sleeps between polls (:data:`NAP_FRACTION`) instead of burning the CPU
    that peer, or anyone else on an oversubscribed node, needs to catch up. None: stages
    that stream large messages keep polling, since MPI moves their data only while both
    ranks are inside MPI calls."""

    __slots__ = ("_gen", "_req", "_spin_s")

    def __init__(self, gen, spin_s: float | None = None):
        self._gen = gen
        self._spin_s = spin_s
        self._req = next(gen, None)

    def test(self) -> bool:
        while self._req is not None and self._req.Test():
            self._req = next(self._gen, None)
        return self._req is None

    def wait(self) -> None:
        """Finish, yielding the core between polls: MPI's own Wait spins, which on a node
        with more ranks than cores steals the CPU from the ranks that are still computing
        (the ones this rank is waiting for); past the spin window of a napping pipeline,
        sleep instead (a yield still runs the poll loop whenever the core is free)."""
        while self._req is not None:
            req = self._req
            if getattr(req, "blocking_wait", False):
                req.Wait()
            else:
                started = time.perf_counter()
                while not req.Test():
                    waited = time.perf_counter() - started
                    if self._spin_s is not None and waited > self._spin_s:
                        time.sleep(min(MAX_NAP_S, max(NAP_S, NAP_FRACTION * waited)))
                    else:
                        os.sched_yield()
            self._req = next(self._gen, None)


class Bucket:
    """Flat gradient storage for ``params`` (in the given order) reduced over ``group``."""

    def __init__(self, index: int, params, group: ReduceGroup, wire_dtype=None):
        self.index = index
        self.params = list(params)
        self.group = group
        dtype = self.params[0].dtype
        device = self.params[0].device
        self.numel = sum(p.numel() for p in self.params)
        used = self.numel + len(self.params)
        size = -(-used // group.size) * group.size
        full = wire_dtype is None or wire_dtype == dtype
        shareable = full and torch.device(device).type == "cpu" and \
            dtype in (torch.float32, torch.float64)
        self.plan = group.plan(size * (dtype if full else wire_dtype).itemsize, shareable)
        self.window = self.segments = None
        self._release_window = None
        if self.plan == "shared":
            self.window, self.segments, self._release_window = \
                group.shared_segments(size, dtype)
            self.flat = self.segments[group.rank]
        else:
            self.flat = message_buffer((size,), dtype, device, zero=True)
        self.views = []
        offset = 0
        for p in self.params:
            self.views.append(shaped_like(self.flat[offset:offset + p.numel()], p))
            offset += p.numel()
        self.flags = self.flat[self.numel:used]
        self.acc_dtype = accumulation_dtype(dtype)
        self.wire = self.flat if full else message_buffer((size,), wire_dtype, device)
        self.channel = group.channel(self.plan)
        self._scratch: dict = {}
        self.pending: Pending | None = None
        self.arrived = [False] * len(self.params)
        self.missing = len(self.params)
        #: sharded optimizer (hpcpar.sync.sharded): the reduction may stop after its
        #: reduce-scatter, only this rank's chunk (``group.rank``) must hold the result
        self.scatter_only = False
        self.local_flags: list[int] = []   # this rank's "has a gradient" flags of the pass

    def close(self) -> None:
        """Free the bucket's communicators and shared-memory window (collective, buckets in
        the same order on every rank). A gradient living in the window moves to memory of
        its own first: the window's pages are returned to the system."""
        if self._release_window is not None:
            storage = self.flat.untyped_storage().data_ptr()
            for p in self.params:
                if p.grad is not None and p.grad.untyped_storage().data_ptr() == storage:
                    p.grad = p.grad.clone()
            self._release_window()
            self._release_window = None
            self.window = self.segments = None
            self.flat = self.wire = self.flags = torch.empty(0, dtype=self.flat.dtype)
            self.views = []
        for comm in self.channel:
            comm.Free()
        self.channel = ()
        self._scratch = {}

    def scratch(self, key: str, shape, dtype) -> torch.Tensor:
        """A temporary kept between steps (large allocations are not free on every step)."""
        t = self._scratch.get(key)
        if t is None:
            t = self._scratch[key] = message_buffer(shape, dtype, self.flat.device)
        return t

    @property
    def wire_bytes(self) -> int:
        return self.wire.numel() * self.wire.element_size()

    def reset(self) -> None:
        self.pending = None
        self.arrived = [False] * len(self.params)
        self.missing = len(self.params)

    def mark(self, slot: int) -> bool:
        """Record that parameter ``slot`` got its gradient in this pass; True when all have."""
        if not self.arrived[slot]:
            self.arrived[slot] = True
            self.missing -= 1
        return self.missing == 0

    def adopt_grads(self) -> None:
        """Make every ``.grad`` live in the flat buffer; None contributes zero; set flags
        (in one write: a tensor item assignment costs ~5 us of dispatch each)."""
        flags = []
        for p, view in zip(self.params, self.views):
            g = p.grad
            if g is None:
                view.zero_()
                flags.append(0)
                continue
            if g.data_ptr() != view.data_ptr():
                view.copy_(g)
                p.grad = view
            flags.append(1)
        self.local_flags = flags
        self.flags.copy_(torch.tensor(flags, dtype=self.flags.dtype))

    def launch(self) -> None:
        self.adopt_grads()
        spin = SPIN_S + SPIN_S_PER_BYTE * self.wire_bytes if self.plan in NAPPING_PLANS \
            else None
        self.pending = Pending(self.group.reduce(self), spin)

    def finalize(self) -> None:
        """After the reduction: grads of parameters with no gradient on any rank stay None;
        with ``scatter_only`` every ``.grad`` is None (only this rank's chunk is reduced)."""
        if self.scatter_only:
            for p in self.params:
                p.grad = None
            return
        for p, view, flag in zip(self.params, self.views, self.flags.tolist()):
            if flag <= 0:
                p.grad = None
            elif p.grad is not view:
                p.grad = view


def assign_buckets(params, cap_bytes: int, first_cap_bytes: int):
    """Split ``params`` (already in launch order) into buckets.

    The first bucket holds at most ``first_cap_bytes`` (a parameter that would overflow it
    starts the next one: communication starts early); later buckets fill until they reach
    ``cap_bytes``, the parameter that reaches it included (torch DDP's rule: a small bias
    rides with the weight after it instead of travelling as a message of its own).
    """
    out: list[list[torch.nn.Parameter]] = []
    current: list[torch.nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not out and current and size + nbytes > first_cap_bytes:
            out.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
        if out and size >= cap_bytes:
            out.append(current)
            current, size = [], 0
    if current:
        out.append(current)
    return out
