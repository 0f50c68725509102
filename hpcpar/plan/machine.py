"""Machine files: the alpha-beta and compute-rate parameters the planner uses.

A machine file (``slurm/machines/NAME.toml``) describes one rank's share of a node:

```toml
name = "perlmutter-gpu"
ranks_per_node = 4            # GPUs (or cores) per node, one rank each
cores = 0                     # optional: cores per node when ranks may oversubscribe them
flops = 9.7e12                # sustained dense conv/GEMM rate per rank, FLOP/s (fp32)
mem_bw = 1.3e12               # sustained memory bandwidth per rank, bytes/s (pointwise layers)
mem_per_rank = 40e9           # device memory per rank, bytes
io_bw = 1.0e9                 # per-rank read bandwidth from the file system, bytes/s
# optional, written by `hpcpar plan --calibrate`: conv_rates = [[in_channels, FLOP/s], ...],
# contention / mem_contention (rate with every core busy / one busy), oversubscription
# (compute per core with two ranks per core / one rank per core), and
# layer_costs = {pool = s/B, pointwise = s/B, bn = s/B} (per input byte, forward + backward),
# gemm_rates = [[narrowest dimension, FLOP/s], ...] (nn.Linear forward + backward),
# graph_costs = {spmm = s per nonzero x column (forward + backward), dropout = s per element}
# and sync_wait (s a message between two ranks waits when each core also runs another busy
# process: time slicing; charged per synchronisation on oversubscribed cores)
[intra]                        # between ranks of one node
alpha = 3e-6                  # latency per message, s
beta = 80e9                   # bandwidth per direction, bytes/s
[inter]                        # between nodes (per rank's share of the NICs)
alpha = 4e-6
beta = 20e9
```
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import tomlkit

from hpcpar import _env
from hpcpar._resources import data_dirs
from hpcpar.errors import ConfigError
from hpcpar.plan.memory import optimizer_states

__all__ = ["Link", "Machine", "REQUIRED", "machines_dir", "load_machine"]


@dataclass(frozen=True)
class Link:
    """An alpha-beta link: a message of n bytes costs ``alpha + n / beta`` seconds."""

    alpha: float  # seconds per message (latency)
    beta: float   # bytes per second (bandwidth)

    def time(self, nbytes: float, messages: int = 1) -> float:
        """Seconds to move ``nbytes`` in ``messages`` messages: ``messages * alpha + nbytes /
        beta``."""
        return messages * self.alpha + nbytes / self.beta


@dataclass(frozen=True)
class Machine:
    """A machine model for the planner: rates, links and calibrated costs (a TOML file).

    Per rank: ``flops`` (sustained FLOP/s), ``mem_bw`` and ``io_bw`` (bytes/s), ``mem_per_rank``
    (bytes); ``intra`` links ranks of a node, ``inter`` nodes.

    Attributes:
        host_cores: Cores that every node shares (virtual nodes on one host, as
            ``hpcpar.testing.cluster`` makes); 0 when each node has its own ``cores``.
        gemm_rates: ``((narrowest GEMM dimension, FLOP/s), ...)`` of ``nn.Linear`` forward +
            backward: a GEMM with 16 rows (a small batch, a narrow GNN layer) runs far below
            the conv rate.
        graph_costs: ``((kind, seconds), ...)``: ``spmm`` per nonzero and column (forward +
            backward, hpcpar's sparse operator), ``dropout`` per element (the vertex-hash
            dropout of GNN layers, forward).
        sync_wait: Extra one-way time of a message between two ranks when every core runs a
            second busy process (the partner is often descheduled: time slicing); the
            planner charges it per synchronisation and per extra rank on a core.
        thread_speedup: Compute speedup of one rank running ``cores`` threads over one
            thread. hpcpar gives each rank ``cores // ranks`` threads, so a rank alone on a
            node computes this much faster than the one-thread rates above say.
        mem_thread_speedup: The same for memory-bound layers and the optimizer.
        opt_costs: ``((optimizer, seconds per parameter), ...)`` of one optimizer step on
            one thread (torch's per-tensor CPU kernels run well below memory bandwidth).
        conv_grid: ``((in_channels, out_channels, FLOP/s), ...)`` on a grid of both: the
            rate depends on each (a layer that halves its channels runs at half the rate of
            one that doubles them, the series ``conv_rates`` measures).
        call_costs: ``((kind, seconds), ...)``: the fixed cost of one call of a spatial
            layer (``conv``, ``pool``, ``bn``), forward + backward, on one thread: its
            Python, halo planning and kernel launches, which no FLOP or byte count carries
            (about 1 ms for a convolution on this VM, 6x torch's own conv3d call); and of one
            graph halo exchange (``graph_halo``, measured between two ranks).
    """

    name: str
    ranks_per_node: int
    flops: float
    mem_bw: float
    mem_per_rank: float
    io_bw: float
    intra: Link
    inter: Link
    description: str = ""
    cores: int = 0  # cores per node; 0 = one per rank. More ranks than cores share them.
    conv_rates: tuple = ()  # optional ((in_channels, FLOP/s), ...) measured by --calibrate
    contention: float = 1.0  # per-rank compute rate with every core busy / with one busy
    #: optional ((kind, seconds per byte of layer input, forward + backward), ...) for the
    #: memory-bound layers (pool, pointwise, bn), measured by --calibrate on hpcpar's layers
    layer_costs: tuple = ()
    mem_contention: float = 1.0  # the same as ``contention`` for memory-bound layers
    #: compute per core with more ranks than cores, relative to one rank per core (time
    #: slicing: context switches and caches refilled after each switch)
    oversubscription: float = 1.0
    host_cores: int = 0
    gemm_rates: tuple = ()
    graph_costs: tuple = ()
    sync_wait: float = 0.0
    thread_speedup: float = 1.0
    mem_thread_speedup: float = 1.0
    opt_costs: tuple = ()
    conv_grid: tuple = ()
    call_costs: tuple = ()

    def slowdown(self, ranks_on_node: int, contention: float | None = None,
                 ranks: int | None = None) -> float:
        """Compute-time factor (1 for one rank) of a node with ``ranks_on_node`` busy ranks:
        shared memory bandwidth and caches (``contention``, default ``self.contention``,
        reached when every core is busy) times oversubscription. ``ranks``: busy ranks of the
        whole job, which share ``host_cores`` when set (so in every method below)."""
        contention = self.contention if contention is None else contention
        ranks_on_node, cores = self._sharing(ranks_on_node, ranks)
        busy = min(max(ranks_on_node, 1), cores)
        frac = (busy - 1) / (cores - 1) if cores > 1 else 0.0
        return (1 + (1 / contention - 1) * frac) / self.compute_share(ranks_on_node, cores)

    def threads(self, ranks_on_node: int, ranks: int | None = None) -> int:
        """Threads hpcpar gives each rank: the cores it shares divided by the busy ranks,
        at least one."""
        busy, cores = self._sharing(ranks_on_node, ranks)
        return max(1, cores // max(1, busy))

    def compute_factors(self, ranks_on_node: int, ranks: int | None = None) -> tuple:
        """``(dense, memory-bound)`` factors on one-thread compute times: contention and
        oversubscription (:meth:`slowdown`) over the speedup of the rank's threads, linear
        between one thread and ``cores``."""
        _, cores = self._sharing(ranks_on_node, ranks)
        frac = (self.threads(ranks_on_node, ranks) - 1) / (cores - 1) if cores > 1 else 0.0
        return (self.slowdown(ranks_on_node, ranks=ranks)
                / (1 + (self.thread_speedup - 1) * frac),
                self.slowdown(ranks_on_node, self.mem_contention, ranks=ranks)
                / (1 + (self.mem_thread_speedup - 1) * frac))

    def optimizer_time(self, optimizer: str, params: int, mem_factor: float = 1.0) -> float:
        """Seconds of one optimizer step over ``params`` parameters: the calibrated cost per
        parameter, else streaming parameters, gradients and state through memory
        (3 + 2 x state passes), times ``mem_factor`` (:meth:`compute_factors`' memory-bound
        one)."""
        costs = dict(self.opt_costs)
        cost = costs.get(optimizer, costs.get("adam") if optimizer == "adamw" else None)
        if cost is None:
            cost = 4 * (3 + 2 * optimizer_states(optimizer)) / self.mem_bw
        return params * cost * mem_factor

    def _sharing(self, ranks_on_node: int, ranks: int | None) -> tuple[int, int]:
        """``(busy ranks, cores they share)``: a node's ranks on its cores, or, with
        ``host_cores``, every node's ranks on the host's cores."""
        if self.host_cores:
            return max(ranks or ranks_on_node, ranks_on_node), self.host_cores
        return ranks_on_node, self.cores or self.ranks_per_node

    def ranks_per_core(self, ranks_on_node: int, ranks: int | None = None) -> float:
        """Busy ranks per core (1 when the cores are not oversubscribed)."""
        busy, cores = self._sharing(ranks_on_node, ranks)
        return max(1.0, busy / cores)

    def sync_delay(self, ranks_on_node: int, ranks: int | None = None) -> float:
        """Seconds each synchronisation (halo exchange, collective) waits for descheduled
        partners: ``sync_wait`` per extra rank on a core (0 with a core per rank)."""
        return self.sync_wait * (self.ranks_per_core(ranks_on_node, ranks) - 1)

    def layer_cost(self, kind: str) -> float | None:
        """Calibrated seconds per input byte (forward + backward) of a memory-bound layer
        (``"pool"``, ``"pointwise"`` or ``"bn"``); None when not calibrated."""
        return dict(self.layer_costs).get(kind)

    def call_cost(self, kind: str) -> float:
        """Calibrated fixed seconds of one call of a layer of ``kind`` (forward + backward,
        one thread); a transposed convolution costs as a convolution; 0 when not
        calibrated."""
        return dict(self.call_costs).get("conv" if kind == "convT" else kind, 0.0)

    def gemm_rate(self, narrowest: int) -> float:
        """Sustained FLOP/s of a dense layer's GEMMs (forward + backward): log-linear in the
        GEMM's narrowest dimension (of rows, input and output features) between the
        calibrated points, else ``flops``."""
        return _log_interp(self.gemm_rates, narrowest, self.flops)

    def graph_cost(self, kind: str) -> float | None:
        """Calibrated cost of a GNN kernel: ``spmm`` (seconds per nonzero and column,
        forward + backward) or ``dropout`` (seconds per element); None when not calibrated."""
        return dict(self.graph_costs).get(kind)

    def conv_rate(self, in_channels: int, out_channels: int | None = None) -> float:
        """Sustained convolution rate (FLOP/s) for a layer.

        With ``out_channels`` and a calibrated ``conv_grid``: the logarithm of the rate
        bilinear in the logarithms of both channel counts, clamped at the grid's edges. Else
        log-linear in the input channels between the ``conv_rates`` points (small channel
        counts run far below peak on CPUs), else ``flops``.
        """
        if out_channels is not None and self.conv_grid:
            ins, outs, lg = self._conv_grid_logs
            (i0, i1, wi), (o0, o1, wo) = _bracket(ins, in_channels), _bracket(outs, out_channels)
            return math.exp((1 - wi) * ((1 - wo) * lg[i0, o0] + wo * lg[i0, o1])
                            + wi * ((1 - wo) * lg[i1, o0] + wo * lg[i1, o1]))
        return _log_interp(self.conv_rates, in_channels, self.flops)

    @cached_property
    def _conv_grid_logs(self) -> tuple:
        """``conv_grid`` as (sorted input counts, sorted output counts, {(in, out): log rate})
        (rates grow geometrically), built once: the planner asks per layer and grid."""
        lg = {(i, o): math.log(r) for i, o, r in self.conv_grid}
        return sorted({i for i, _ in lg}), sorted({o for _, o in lg}), lg

    def compute_share(self, ranks_on_node: int, cores: int | None = None) -> float:
        """Fraction of a core each of ``ranks_on_node`` ranks sharing ``cores`` (default the
        node's) gets: 1 unless the cores are oversubscribed."""
        cores = cores or self.cores or self.ranks_per_node
        if ranks_on_node <= cores:
            return 1.0
        return cores / ranks_on_node * self.oversubscription

    def to_toml(self) -> str:
        """The machine as a machine file (what ``load_machine`` reads).

        Written with ``tomlkit`` (as ``hpcpar run --print-config`` is), so a ``name`` or
        ``description`` with quotes, backslashes or newlines reads back unchanged.
        """
        d = asdict(self)
        doc = tomlkit.document()
        for key in ("name", "description", "ranks_per_node", "cores", "flops", "mem_bw",
                    "mem_per_rank", "io_bw", "contention", "mem_contention", "oversubscription",
                    "host_cores", "sync_wait", "thread_speedup", "mem_thread_speedup"):
            doc.add(key, d[key])
        # calibrated tables: by name (inline TOML tables) or by number (arrays of rows)
        for key in ("layer_costs", "conv_rates", "gemm_rates", "graph_costs", "opt_costs",
                    "conv_grid", "call_costs"):
            rows = getattr(self, key)
            if rows and isinstance(rows[0][0], str):
                named = tomlkit.inline_table()
                named.update(dict(rows))
                doc.add(key, named)
            elif rows:
                doc.add(key, [list(row) for row in rows])
        for sec in ("intra", "inter"):
            doc.add(sec, tomlkit.table().add("alpha", d[sec]["alpha"]).add("beta",
                                                                          d[sec]["beta"]))
        return tomlkit.dumps(doc)


def _bracket(xs: list, x: float) -> tuple:
    """``(lower, upper, weight of upper)`` of ``x`` among sorted ``xs``, in log space,
    clamped at both ends."""
    if x <= xs[0]:
        return xs[0], xs[0], 0.0
    for a, b in zip(xs, xs[1:]):
        if x <= b:
            return a, b, math.log(x / a) / math.log(b / a)
    return xs[-1], xs[-1], 0.0


def _log_interp(points, x: float, default: float) -> float:
    """Log-linear interpolation in ``x`` between sorted ``(x, rate)`` points, clamped at both
    ends; ``default`` without points."""
    if not points:
        return default
    rate = dict(points)
    a, b, w = _bracket(sorted(rate), x)
    return rate[a] + w * (rate[b] - rate[a])


REQUIRED = {"ranks_per_node": int, "flops": float, "mem_bw": float, "mem_per_rank": float,
            "io_bw": float}


def machines_dir() -> Path:
    """``HPCPAR_MACHINES``, else ``machines/`` of hpcpar's slurm data (installed package data
    or the source checkout's ``slurm/``)."""
    folder = _env.get("HPCPAR_MACHINES")
    if folder:
        return Path(folder)

    dirs = [d / "machines" for d in data_dirs()]
    return next((d for d in dirs if d.is_dir()), dirs[-1] if dirs else Path("slurm/machines"))


def load_machine(name_or_path: str) -> Machine:
    """Load a machine file: a path, or a name in ``machines_dir()``; ConfigError when not found,
    invalid TOML, or with a missing key or a bad value."""
    path = Path(name_or_path)
    if not path.suffix:
        path = machines_dir() / f"{name_or_path}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in machines_dir().glob("*.toml"))
        raise ConfigError(f"machine file {path}: not found (known machines: "
                          f"{', '.join(known) or 'none'})")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"machine file {path}: not valid TOML ({exc})") from None
    for key in REQUIRED:
        if key not in raw:
            raise ConfigError(f"machine file {path}: missing key {key!r}")
        if not isinstance(raw[key], (int, float)) or raw[key] <= 0:
            raise ConfigError(f"machine file {path}: {key} must be a positive number")
    links = {}
    for sec in ("intra", "inter"):
        s = raw.get(sec)
        if not isinstance(s, dict) or not {"alpha", "beta"} <= set(s):
            raise ConfigError(f"machine file {path}: section [{sec}] needs alpha and beta")
        links[sec] = Link(float(s["alpha"]), float(s["beta"]))
    return Machine(name=str(raw.get("name", path.stem)), ranks_per_node=int(raw["ranks_per_node"]),
                   flops=float(raw["flops"]), mem_bw=float(raw["mem_bw"]),
                   mem_per_rank=float(raw["mem_per_rank"]), io_bw=float(raw["io_bw"]),
                   intra=links["intra"], inter=links["inter"],
                   description=str(raw.get("description", "")), cores=int(raw.get("cores", 0)),
                   conv_rates=tuple((int(c), float(r)) for c, r in raw.get("conv_rates", ())),
                   conv_grid=tuple((int(i), int(o), float(r))
                                   for i, o, r in raw.get("conv_grid", ())),
                   contention=float(raw.get("contention", 1.0)),
                   mem_contention=float(raw.get("mem_contention", 1.0)),
                   oversubscription=float(raw.get("oversubscription", 1.0)),
                   host_cores=int(raw.get("host_cores", 0)),
                   sync_wait=float(raw.get("sync_wait", 0.0)),
                   thread_speedup=float(raw.get("thread_speedup", 1.0)),
                   mem_thread_speedup=float(raw.get("mem_thread_speedup", 1.0)),
                   opt_costs=tuple((str(k), float(v)) for k, v in
                                   dict(raw.get("opt_costs", {})).items()),
                   layer_costs=tuple((str(k), float(v)) for k, v in
                                     dict(raw.get("layer_costs", {})).items()),
                   call_costs=tuple((str(k), float(v)) for k, v in
                                    dict(raw.get("call_costs", {})).items()),
                   gemm_rates=tuple((int(c), float(r)) for c, r in raw.get("gemm_rates", ())),
                   graph_costs=tuple((str(k), float(v)) for k, v in
                                     dict(raw.get("graph_costs", {})).items()))
