"""Data-parallel gradient synchronisation: ``hpcpar.DistributedDataParallel`` (``hpcpar.DDP``).

Reduction semantics (what ``.grad`` holds when ``loss.backward()`` returns):

* a replicated parameter (default, ``reduce_scope(p) == "spatial+data"``) gets the SUM over
  the spatial group (each spatial rank computed the partial gradient of its sub-volume) and
  the AVERAGE over the data group: one reduction over all ranks, divided by ``grid.data``;
* a parameter tagged ``hpcpar.sync.tags.tag_data_only(p)`` (tensor-parallel shards, layers run
  redundantly on gathered data) gets the AVERAGE over the data group only.

With a loss that is a per-sample mean on each rank this equals the single-process gradient of
the mean loss over the whole global batch. Precisely: after the sync, ``p.grad`` is the
reduction of every rank's ``p.grad`` at the end of backward, whatever it accumulated —
gradients accumulated inside :meth:`no_sync` are included, a ``None`` counts as zero, and a
gradient that is ``None`` on every rank stays ``None``.

Mechanics: gradients live in flat buckets (reverse registration order, first bucket small);
a post-accumulate-grad hook marks a parameter ready and launches every bucket whose turn has
come, in the same bucket order on every rank; the end of backward (an autograd-engine
callback) launches buckets still waiting (parameters without a gradient this step) and waits
for all of them. See :mod:`hpcpar.sync._buckets` for the reduction itself,
:mod:`hpcpar.sync._stall` for the stall detector and :mod:`hpcpar.sync._compression` for 16-bit
transport.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from hpcpar.errors import CommError, ConfigError
from hpcpar.parallel.comm import bcast_
from hpcpar.parallel.counters import COUNTERS, profiled
from hpcpar.parallel.grid import ProcessGrid
from hpcpar.sync._buckets import MB, Bucket, ReduceGroup, TorchGroup, assign_buckets
from hpcpar.sync._compression import wire_dtype_for
from hpcpar.sync._stall import StallMonitor
from hpcpar.sync._torchdist import check_grad_sync
from hpcpar.sync.tags import DATA_ONLY, TAGS_VERSION, reduce_scope

__all__ = ["DistributedDataParallel", "DDP"]


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so ``loss.backward()`` also synchronises its gradients over ``grid``.

    After ``loss.backward()`` returns, a replicated parameter's ``.grad`` is the sum over the
    spatial group and the average over the data group; a parameter tagged
    ``hpcpar.sync.tags.tag_data_only`` gets the average over the data group only. With a
    per-sample mean loss this is the single-process gradient of the global-batch mean.
    Construction is collective: it checks that every rank wraps the same model and
    broadcasts rank 0's parameters and buffers.

    ``state_dict()``/``load_state_dict()`` are the wrapped module's (no ``module.`` prefix;
    loading also accepts a torch-DDP state dict with that prefix).

    ``grid`` None is ``ProcessGrid()`` (all ranks on the data axis). Bucket sizes are in MB;
    the first bucket launches early. ``hierarchical``: ``"auto"`` (on with more than one node
    and more than one rank per node), True or False; bitwise identical results either way in
    fp32/fp64. ``compression``: None, ``"fp16"`` or ``"bf16"``: 16-bit transport, fp32 sums
    (with NCCL, sums in the 16-bit type itself). ``grad_sync``: ``"mpi"`` or ``"nccl"`` (CUDA
    models: a torch.distributed group bootstrapped from the grid's MPI communicator, same
    buckets, overlap and ``no_sync``; halo exchange stays on MPI); ``"gloo"`` makes the same
    kind of group on CPU (for tests of that path).

    Raises ConfigError for an unknown ``hierarchical``, ``compression`` or ``grad_sync``, or
    ``"nccl"`` for a model not on a CUDA device; CommError on every rank, naming the
    parameter, when the model differs across ranks (names, shapes, dtypes, ``requires_grad``).

    Example:
        ```python
        ddp = hpcpar.DDP(model, grid)
        loss_fn(ddp(x), y).backward()    # grads synchronised when backward returns
        opt.step()
        ```
    """

    def __init__(self, module: nn.Module, grid: ProcessGrid | None = None, *,
                 bucket_cap_mb: float = 25, first_bucket_mb: float = 1,
                 hierarchical: bool | str = "auto", compression: str | None = None,
                 grad_sync: str = "mpi"):
        super().__init__()
        if hierarchical not in ("auto", True, False):
            raise ConfigError(f"DistributedDataParallel: hierarchical={hierarchical!r}, "
                              "expected 'auto', True or False")
        wire = wire_dtype_for(compression)
        self._backend = check_grad_sync(grad_sync, {p.device.type for p in module.parameters()
                                                    if p.requires_grad})
        self.grad_sync = grad_sync
        self.module = module
        self.grid = grid if grid is not None else ProcessGrid()
        self.compression = compression
        self._check_same_model()
        self._broadcast_state()
        self._plan_args = (hierarchical, bucket_cap_mb * MB, first_bucket_mb * MB, wire)
        self._stall = StallMonitor(self.grid.comm)
        self._require_sync = True
        self._on_scattered = None   # set by hpcpar.sync.sharded.ShardedOptimizer
        self._groups: dict = {}
        self._all_groups: list = []       # every group made, for close()
        self._retired: list[Bucket] = []  # a re-plan's old buckets, until released
        self.closed = False
        self._reset_pass()
        self._step = 0
        self._plan()
        self._tags_seen = getattr(module, TAGS_VERSION, 0)
        # a spatialized model learns which parameters are replicated from its forward's
        # dataflow (hpcpar.nn.spatializer): re-plan the buckets when it changes its tags
        self._forward_hook = module.register_forward_hook(self._after_forward)

    def _plan(self) -> None:
        """Reduction groups, buckets and gradient hooks from the parameters' current tags."""
        hierarchical, cap, first_cap, wire = self._plan_args
        self._groups = self._make_groups(hierarchical)
        self.hierarchical = self._groups["world"].hierarchical
        self._buckets = self._make_buckets(cap, first_cap, wire)
        for b in self._buckets:
            b.scatter_only = self._on_scattered is not None
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(b, i))
                         for b in self._buckets for i, p in enumerate(b.params)]

    def _after_forward(self, module, args, output) -> None:
        version = getattr(module, TAGS_VERSION, 0)
        if version != self._tags_seen:  # every rank ran the same forward: all re-plan here
            self._tags_seen = version
            self._unhook_grads()
            self._check_same_model()
            self._retired += self._buckets
            self._plan()
            if self._on_scattered is None:  # else the sharded optimizer moves its state first
                self._release_retired()

    def _release_retired(self) -> None:
        """Free the buckets a re-plan replaced (collective, in bucket order)."""
        retired, self._retired = self._retired, []
        for b in retired:
            b.close()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped module (CommError after ``close()``: its gradients would no longer
        be synchronised)."""
        if self.closed:
            raise CommError("DistributedDataParallel: called after close(); its gradients "
                            "would not be synchronised (wrap the module again)")
        return self.module(*args, **kwargs)

    def close(self) -> None:
        """Release the gradient buckets' shared-memory windows and communicators, the stall
        detector and the hooks, now instead of at exit (collective: every rank calls it).

        For code that builds many wrappers in one process (sweeps, test suites): each one
        otherwise holds a gradient-sized shared window per rank until the process ends.
        ``.grad`` tensors survive (moved out of the windows); the module trains on unwrapped.
        Closing twice is a no-op. ``with hpcpar.DDP(model, grid) as ddp:`` closes on leaving.
        """
        if self.closed:
            return
        self.closed = True
        self.remove_hooks()
        self._retired += self._buckets
        self._buckets = []
        self._release_retired()
        for group in self._all_groups:
            group.close()
        self._all_groups = []
        self._groups = {}
        self._stall.close()

    def __enter__(self) -> DistributedDataParallel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes run while this is active only accumulate local gradients; the
        next backward outside reduces everything accumulated in ``.grad``.

        Unlike torch DDP, the context active when *backward* runs decides (torch: when the
        forward ran). Either way wrapping forward and backward, as in torch's examples, does
        the same; a backward that syncs "too early" is only extra traffic, never a wrong
        result, because the reduction is linear."""
        old = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = old

    @property
    def bucket_layout(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [[names[id(p)] for p in b.params] for b in self._buckets]

    @property
    def sync_steps(self) -> int:
        """Number of gradient synchronisations so far (the step the stall detector reports)."""
        return self._step

    # forwards every form of torch's overloaded state_dict, which one signature cannot spell
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped module's state dict (no ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load into the wrapped module, as ``nn.Module.load_state_dict``; a torch-DDP state
        dict (``module.`` keys) also loads."""
        keys = list(state_dict)
        if keys and all(k.startswith("module.") for k in keys):
            state_dict = {k[len("module."):]: v for k, v in state_dict.items()}
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _shard_gradients(self, on_scattered) -> None:
        """Stop each bucket's reduction after its reduce-scatter and call ``on_scattered()``
        once every bucket is done (the sharded optimizer's hook: hpcpar.sync.sharded)."""
        self._on_scattered = on_scattered
        for b in self._buckets:
            b.scatter_only = True

    def remove_hooks(self) -> None:
        """Detach from the module (it then trains without synchronisation)."""
        self._unhook_grads()
        self._forward_hook.remove()

    def _unhook_grads(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _check_same_model(self) -> None:
        """Same names/dtypes everywhere, same shapes where replicated; one error on all ranks."""
        grid = self.grid
        world: list[tuple] = []
        data: list[tuple] = []
        for name, p in self.module.named_parameters():
            scope = reduce_scope(p)
            shared = scope == DATA_ONLY and grid.spatial_size > 1
            world.append(("parameter", name, None if shared else tuple(p.shape), str(p.dtype),
                          scope, p.requires_grad))
            if shared:
                data.append(("parameter", name, tuple(p.shape)))
        for name, b in self.module.named_buffers():
            world.append(("buffer", name, tuple(b.shape), str(b.dtype)))
        problem = _difference(grid.comm.allgather(world))
        if problem is None and data:
            problem = _difference(grid.data_comm.allgather(data), "data-axis ")
        problems = grid.comm.allgather(problem) if grid.spatial_size > 1 else [problem]
        problem = next((p for p in problems if p is not None), None)
        if problem is not None:
            raise CommError(f"DistributedDataParallel: the model differs across "
                            f"ranks: {problem}")

    @torch.no_grad()
    def _broadcast_state(self) -> None:
        """Rank 0's parameters and buffers everywhere (data-only parameters: over the data
        axis, since tensor-parallel shards differ along the spatial axes)."""
        grid = self.grid
        world: list[torch.Tensor] = []
        data: list[torch.Tensor] = []
        for p in self.module.parameters():
            (data if reduce_scope(p) == DATA_ONLY and grid.spatial_size > 1 else world).append(p)
        world += list(self.module.buffers())
        _broadcast_coalesced(world, grid.comm)
        if data:
            _broadcast_coalesced(data, grid.data_comm)

    def _make_groups(self, hierarchical) -> dict:
        """The world group, and the data group where data-only parameters need one; a
        re-plan keeps the groups it already has (they hold communicators or NCCL groups)."""
        grid = self.grid
        trained = [p for p in self.module.parameters() if p.requires_grad]
        if self._backend is None:
            def group(comm):
                return ReduceGroup(comm, grid.node_index, grid.data, hierarchical)
        else:
            device = trained[0].device if trained else None

            def group(comm):
                return TorchGroup(comm, grid.data, self._backend, device)
        world = self._groups.get("world") or group(grid.comm)
        needs_data = grid.spatial_size > 1 and any(reduce_scope(p) == DATA_ONLY for p in trained)
        data = next((g for g in self._all_groups if g is not world), None)
        if needs_data and data is None:
            data = group(grid.data_comm)
        self._all_groups = [world] + ([data] if data is not None else [])
        return {"world": world, "data": data if needs_data else world}

    def _make_buckets(self, cap: float, first_cap: float, wire) -> list[Bucket]:
        """Per (reduction group, dtype, device): buckets in reverse registration order;
        all of them ordered by their first parameter, which fixes the launch order."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        order = {id(p): i for i, p in enumerate(reversed(params))}
        keyed: dict = {}
        for p in reversed(params):
            group = "data" if reduce_scope(p) == DATA_ONLY else "world"
            keyed.setdefault((group, p.dtype, str(p.device)), []).append(p)
        lists = []
        for (group, _, _), ps in keyed.items():
            for chunk in assign_buckets(ps, int(cap), int(first_cap)):
                lists.append((order[id(chunk[0])], group, chunk))
        lists.sort(key=lambda t: t[0])
        return [Bucket(i, chunk, self._groups[group], wire)
                for i, (_, group, chunk) in enumerate(lists)]

    def _reset_pass(self) -> None:
        self._pass_active = False
        self._pass_sync = False
        self._next = 0      # next bucket to launch
        self._done = 0      # first bucket not known to be complete
        self._t_first: float | None = None
        self._t_hooks = 0.0

    def _make_hook(self, bucket: Bucket, slot: int):
        def hook(param):
            t0 = time.perf_counter()
            if not self._pass_active:
                self._begin_pass()
            if self._pass_sync:
                if bucket.mark(slot):
                    self._launch_ready()
                self._progress()
                if self._t_first is not None:  # exposed: only once communication started
                    self._t_hooks += time.perf_counter() - max(t0, self._t_first)
        return hook

    def _begin_pass(self) -> None:
        self._pass_active = True
        self._pass_sync = self._require_sync
        torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)

    @profiled("hpcpar.allreduce.launch")
    def _launch(self, bucket: Bucket) -> None:
        if self._t_first is None:
            self._t_first = time.perf_counter()
            self._step += 1
            self._stall.reached(self._step)
        bucket.launch()
        self._next += 1

    def _launch_ready(self) -> None:
        buckets = self._buckets
        while self._next < len(buckets) and buckets[self._next].missing == 0:
            self._launch(buckets[self._next])

    def _progress(self) -> None:
        """Advance in-flight reductions (MPI progresses only inside MPI calls)."""
        prefix = True
        for b in self._buckets[self._done:self._next]:
            assert b.pending is not None  # launched
            finished = b.pending.test()  # every in-flight bucket moves to its next stage
            prefix = prefix and finished
            if prefix:
                self._done += 1

    def _end_pass(self) -> None:
        try:
            if self._pass_sync:
                self._finish_sync()
        finally:
            self._reset_pass()

    @profiled("hpcpar.allreduce")
    def _finish_sync(self) -> None:
        t0 = time.perf_counter()
        while self._next < len(self._buckets):
            self._launch(self._buckets[self._next])
        self._stall.arm()
        try:
            for b in self._buckets[self._done:]:
                assert b.pending is not None  # every bucket was launched above
                b.pending.wait()
        finally:
            self._stall.disarm()
        for b in self._buckets:
            b.finalize()
            b.reset()
        if self._on_scattered is not None:
            self._on_scattered()
        t_end = time.perf_counter()
        if self.grid.size > 1:  # one rank sends nothing: its bucket copies are local work
            assert self._t_first is not None  # set by the first launch
            COUNTERS.t_allreduce_total += t_end - self._t_first
            COUNTERS.t_allreduce_exposed += self._t_hooks + t_end - t0
            COUNTERS.bytes_allreduce += sum(b.wire_bytes for b in self._buckets)


def _difference(signatures: list, where: str = "") -> str | None:
    """First difference between rank 0's model signature and another rank's, as words."""
    first = signatures[0]
    for rank, sig in enumerate(signatures):
        if sig == first:
            continue
        for a, b in zip(first, sig):
            if a == b:
                continue
            kind, name = a[0], a[1]
            if (b[0], b[1]) != (kind, name):
                return (f"rank 0 has {kind} {name!r} where rank {rank} has {b[0]} {b[1]!r} "
                        "(different architectures?)")
            fields = ("shape", "dtype", "reduce scope", "requires_grad")
            for label, x, y in zip(fields, a[2:], b[2:]):
                if x != y:
                    return (f"{kind} {name!r} has {where}{label} {x} on rank 0 but {y} on "
                            f"rank {rank}")
        n0 = sum(1 for e in first if e[0] == "parameter")
        n1 = sum(1 for e in sig if e[0] == "parameter")
        return (f"rank 0 has {n0} parameters and {len(first) - n0} buffers, rank {rank} has "
                f"{n1} parameters and {len(sig) - n1} buffers")
    return None


def _broadcast_coalesced(tensors, comm, root: int = 0) -> None:
    """Broadcast ``tensors`` from ``root`` with one message per dtype/device."""
    if comm.Get_size() == 1:
        return
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for ts in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        bcast_(flat, comm, root)
        offset = 0
        for t in ts:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


DDP = DistributedDataParallel
