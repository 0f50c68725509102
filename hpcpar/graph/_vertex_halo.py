"""Graph halo exchange: owners send their boundary rows to the ranks that need them.

Local vertex order on every rank: owned vertices ``[0, n_owned)`` (sorted by global id), then
the halo vertices grouped by owner rank (ascending), sorted by global id inside a group. A
single Alltoallv therefore lands received rows exactly in place (``x_full = [x; halo]``), and
in backward the gradient rows of the halo go back to their owners as one contiguous block per
owner, where they are scatter-ADDED (``index_add_``) into the owned rows they came from.

Every exchange (forward and backward) runs under the stall detector
(:mod:`hpcpar.sync._stall`, ``HPCPAR_STALL_TIMEOUT``): a rank that never reaches an exchange
the others wait in (one more layer, one fewer epoch) is named in one line and the job aborts.

:class:`SampledHaloPlan` is one training step's BNS-GCN boundary sample of a plan: a seeded fraction
of each owner's boundary rows travels, chosen per (step, sender, receiver) so both sides know the
sample without exchanging it."""

from __future__ import annotations

import time

import numpy as np
import torch

from hpcpar.parallel.comm import alltoallv
from hpcpar.parallel.counters import COUNTERS, profiled
from hpcpar.sync._stall import StallMonitor


class HaloPlan:
    """Who sends which owned rows to whom.

    ``send_index``: local owned rows to send, concatenated in destination-rank order;
    ``send_rows[r]`` of them go to rank ``r``; ``recv_rows[r]`` halo rows come from rank ``r``.
    Built collectively by :meth:`build` (one Alltoall of counts + one Alltoallv of ids)."""

    def __init__(self, comm, n_owned: int, send_index: np.ndarray, send_rows, recv_rows):
        self.comm = comm
        self.n_owned = int(n_owned)
        self.send_index_np = np.asarray(send_index, np.int64)
        self.send_index = torch.from_numpy(self.send_index_np)
        self.send_rows = [int(r) for r in send_rows]
        self.recv_rows = [int(r) for r in recv_rows]
        self.n_halo = sum(self.recv_rows)
        self.bytes_sent = 0  # running total of bytes this rank sent (forward + backward)
        self.stall = StallMonitor(comm, what="graph halo exchange")  # collective
        self.exchanges = 0  # exchanges so far (the stall detector's step)

    @classmethod
    def build(cls, comm, owned_ids: np.ndarray, halo_ids: np.ndarray, halo_owner: np.ndarray):
        """``halo_ids`` must already be grouped by ``halo_owner`` (ascending)."""
        size = comm.Get_size()
        recv_rows = np.bincount(halo_owner, minlength=size).astype(np.int64)
        asked = alltoallv(torch.from_numpy(np.ascontiguousarray(halo_ids, np.int64)),
                          recv_rows.tolist(), comm)
        send_rows = comm.alltoall(recv_rows.tolist())
        wanted = asked.numpy()
        send_index = np.searchsorted(owned_ids, wanted)
        if wanted.size and not np.array_equal(owned_ids[np.minimum(send_index,
                                                                   owned_ids.size - 1)],
                                              wanted):
            raise RuntimeError("graph halo plan: a rank asked for a vertex this rank does not "
                               "own (inconsistent owner arrays across ranks)")
        return cls(comm, owned_ids.shape[0], send_index, send_rows, recv_rows)

    @property
    def distributed(self) -> bool:
        return self.comm.Get_size() > 1

    def to(self, device) -> HaloPlan:
        self.send_index = self.send_index.to(device)
        return self

    def fetch(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Halo rows (``n_halo``, ...) of the owned rows ``x`` (forward direction), received
        into ``out`` when given (the tail of ``[x; halo]``: no copy of the halo afterwards)."""
        t0 = time.perf_counter()
        send = x.index_select(0, self.send_index) if self.send_index.numel() else \
            x.new_empty((0, *x.shape[1:]))
        t1 = time.perf_counter()
        halo = self._alltoallv(send, self.send_rows, self.recv_rows, out)
        COUNTERS.t_halo_wait += time.perf_counter() - t1  # the communication part
        self._count(send, t0)
        return halo

    def give_back(self, g_halo: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """Adjoint of :meth:`fetch`: halo gradient rows summed at the owners, added into
        ``into`` (``(n_owned, ...)``, the owned rows' own gradient; zeros when None)."""
        t0 = time.perf_counter()
        g_send = self._alltoallv(g_halo.contiguous(), self.recv_rows, self.send_rows)
        COUNTERS.t_halo_wait += time.perf_counter() - t0  # the communication part
        out = g_halo.new_zeros((self.n_owned, *g_halo.shape[1:])) if into is None else into
        if g_send.shape[0]:
            out.index_add_(0, self.send_index, g_send)
        self._count(g_halo, t0)
        return out

    def _alltoallv(self, send: torch.Tensor, send_rows, recv_rows,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """One exchange, timed by the stall detector."""
        self.exchanges += 1
        self.stall.reached(self.exchanges)
        self.stall.arm()
        try:
            return alltoallv(send, send_rows, self.comm, recv_rows, out)
        finally:
            self.stall.disarm()

    def _count(self, sent: torch.Tensor, t0: float) -> None:
        nbytes = sent.numel() * sent.element_size()
        self.bytes_sent += nbytes
        COUNTERS.bytes_halo += nbytes
        COUNTERS.t_graph_halo += time.perf_counter() - t0

    def bytes_per_exchange(self, features: int, itemsize: int = 4) -> int:
        """Bytes this rank sends in one forward exchange of ``features`` columns."""
        return int(self.send_index_np.shape[0]) * features * itemsize

    @property
    def exact(self) -> HaloPlan:
        """The full plan (for one-off exchanges that must not be sampled, e.g. degrees)."""
        return self


#: tag of the boundary-sampling random stream (keeps it apart from any other seeded stream)
_BNS_STREAM = 0x424E53


def sample_size(n: int, p: float) -> int:
    """Rows kept out of a boundary block of ``n``: ``round(p * n)``, at least one (so no
    neighbour rank drops out of an epoch entirely), all of them at ``p = 1``."""
    return min(n, max(1, int(round(p * n)))) if n else 0


def sample_positions(n: int, p: float, seed: int, call: int, sender: int,
                     receiver: int) -> np.ndarray:
    """Which of the ``n`` boundary rows ``sender`` owes ``receiver`` travel in step ``call``.

    A pure function of its arguments, so sender and receiver draw the same sample with no message
    about it. Returns ``sample_size(n, p)`` ascending positions in ``[0, n)``."""
    k = sample_size(n, p)
    if k == n:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng([_BNS_STREAM, seed, call, sender, receiver])
    return np.sort(rng.choice(n, k, replace=False)).astype(np.int64)


class SampledHaloPlan:
    """One training step's boundary sample of a :class:`HaloPlan` (BNS-GCN).

    For every (sender, receiver) pair only ``sample_size(n, p)`` of the ``n`` boundary rows travel,
    drawn by :func:`sample_positions`. The receiver scales them by ``n / k`` (BNS-GCN's ``1 /
    ratio``: an unbiased estimate of the full aggregation) and leaves the unsampled halo rows zero,
    so the unchanged aggregation operator drops exactly the edges to unsampled vertices.
    ``give_back`` is the exact adjoint: the sampled rows' gradients, scaled by the same ``n / k``,
    go back to their owners. Exchanges count on the full plan's stall detector. ``0 < p <= 1``;
    ``call`` is the training step (a fresh sample per step)."""

    def __init__(self, plan: HaloPlan, p: float, seed: int, call: int):
        self.base = plan
        self.n_owned, self.n_halo = plan.n_owned, plan.n_halo
        rank = plan.comm.Get_rank()
        send, self.send_rows = self._pick(plan.send_rows, p, seed, call, rank, True)
        recv, self.recv_rows = self._pick(plan.recv_rows, p, seed, call, rank, False)
        self.send_index_np = plan.send_index_np[send]
        device = plan.send_index.device
        self.send_index = torch.from_numpy(self.send_index_np).to(device)
        self.recv_index = torch.from_numpy(recv).to(device)
        scale = np.repeat([n / k if k else 0.0 for n, k in zip(plan.recv_rows, self.recv_rows)],
                          self.recv_rows)
        self._scale = torch.from_numpy(scale)
        self.halo_scale = np.zeros(plan.n_halo)  # per halo row: n / k if sampled, else 0
        self.halo_scale[recv] = scale

    @staticmethod
    def _pick(rows, p, seed, call, rank, sending):
        """Positions (in the full plan's row order) of the sampled rows, and rows per peer."""
        picked, counts, offset = [], [], 0
        for peer, n in enumerate(rows):
            pos = sample_positions(n, p, seed, call, *((rank, peer) if sending else
                                                       (peer, rank)))
            picked.append(offset + pos)
            counts.append(int(pos.shape[0]))
            offset += n
        return np.concatenate(picked) if picked else np.zeros(0, np.int64), counts

    @property
    def distributed(self) -> bool:
        return self.base.distributed

    @property
    def exact(self) -> HaloPlan:
        """The full plan."""
        return self.base

    def to(self, device) -> SampledHaloPlan:
        self.send_index = self.send_index.to(device)
        self.recv_index = self.recv_index.to(device)
        return self

    def _scaled(self, rows: torch.Tensor) -> torch.Tensor:
        scale = self._scale.to(rows.device, rows.dtype)
        return rows * scale.reshape(-1, *([1] * (rows.dim() - 1)))

    def fetch(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``(n_halo, ...)``: the sampled halo rows scaled by ``n / k``, zeros elsewhere
        (written into ``out`` when given)."""
        t0 = time.perf_counter()
        send = x.index_select(0, self.send_index)
        t1 = time.perf_counter()
        got = self.base._alltoallv(send, self.send_rows, self.recv_rows)
        COUNTERS.t_halo_wait += time.perf_counter() - t1
        halo = x.new_zeros((self.n_halo, *x.shape[1:])) if out is None else out.zero_()
        halo[self.recv_index] = self._scaled(got)
        self.base._count(send, t0)
        return halo

    def give_back(self, g_halo: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """Adjoint of :meth:`fetch`: the sampled rows' gradients, scaled, summed at owners
        (added into ``into`` when given)."""
        t0 = time.perf_counter()
        g = self._scaled(g_halo.index_select(0, self.recv_index)).contiguous()
        g_send = self.base._alltoallv(g, self.recv_rows, self.send_rows)
        COUNTERS.t_halo_wait += time.perf_counter() - t0
        out = g_halo.new_zeros((self.n_owned, *g_halo.shape[1:])) if into is None else into
        if g_send.shape[0]:
            out.index_add_(0, self.send_index, g_send)
        self.base._count(g, t0)
        return out

    def bytes_per_exchange(self, features: int, itemsize: int = 4) -> int:
        """Bytes this rank sends in one forward exchange of ``features`` columns."""
        return int(self.send_index_np.shape[0]) * features * itemsize


class GraphHaloExchange(torch.autograd.Function):
    """``x_owned -> [x_owned; halo]``; backward scatter-adds halo gradients to the owners."""

    @staticmethod
    @profiled("hpcpar.graph_halo")
    def forward(ctx, x, plan: HaloPlan | SampledHaloPlan):
        ctx.plan = plan
        full = x.new_empty((plan.n_owned + plan.n_halo, *x.shape[1:]))
        full[:plan.n_owned] = x
        plan.fetch(x.contiguous(), out=full[plan.n_owned:])   # received in place
        return full

    @staticmethod
    @profiled("hpcpar.graph_halo.backward")
    def backward(ctx, g):
        plan = ctx.plan
        own = g[:plan.n_owned].clone(memory_format=torch.contiguous_format)
        return plan.give_back(g[plan.n_owned:], into=own), None   # halo gradients added in


@profiled("hpcpar.graph_halo")
def _fetch_into(plan, x: torch.Tensor, out: torch.Tensor) -> None:
    plan.fetch(x, out=out)


@profiled("hpcpar.graph_halo.backward")
def _give_back_into(plan, g_halo: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
    return plan.give_back(g_halo, into=into)


class HaloAggregate(torch.autograd.Function):
    """``op @ [x; halo(x)]`` in one step, what aggregation over a distributed graph is.

    The halo rows land in a tensor of their own and the SpMM reads both blocks in place
    (``op.apply_split``), so ``[x; halo]`` is never assembled; backward computes ``op^T g``
    once, sends the halo part back to the owners and adds it into the owned part in place
    (the buffer is this function's own). Same bits as ``op(with_halo(x, plan))``."""

    @staticmethod
    def forward(ctx, x, plan: HaloPlan | SampledHaloPlan, op):
        ctx.plan, ctx.op = plan, op
        x = x.contiguous()
        halo = x.new_empty((plan.n_halo, *x.shape[1:]))
        _fetch_into(plan, x, halo)
        return op.apply_split(x, halo)

    @staticmethod
    def backward(ctx, g):
        n = ctx.plan.n_owned
        full = ctx.op.apply(g.contiguous(), transpose=True)
        return _give_back_into(ctx.plan, full[n:], full[:n]), None, None


def aggregate(x: torch.Tensor, plan: HaloPlan | SampledHaloPlan, op) -> torch.Tensor:
    """``op @ [x; halo]``: :class:`HaloAggregate` where the operator reads split inputs,
    else ``op(with_halo(x, plan))``."""
    if plan.distributed and op.reads_split(x):
        return HaloAggregate.apply(x, plan, op)
    return op(with_halo(x, plan))


def with_halo(x: torch.Tensor, plan: HaloPlan | SampledHaloPlan) -> torch.Tensor:
    """Owned rows followed by halo rows (identity on a single rank)."""
    if not plan.distributed:
        return x
    return GraphHaloExchange.apply(x, plan)
