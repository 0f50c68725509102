"""A job as the planner sees it: the job spec's model built on the meta device and traced into
per-layer costs (volume jobs), or its graph file partitioned as the run would (full-graph
jobs); finished runs as measured points to fit the machine model on; the largest sample that
fits a memory budget per grid. The adapter between the job format and :mod:`.planner`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hpcpar.data import read_manifest
from hpcpar.errors import ConfigError, HpcparError
from hpcpar.formats.jobspec import load_job, load_resolved
from hpcpar.formats.kinds import get_workload
from hpcpar.parallel.grid import resolve_shape
from hpcpar.plan.gnn import GraphJob, Part
from hpcpar.plan.memory import HEADROOM, estimate, largest_edge
from hpcpar.plan.planner import BYTES, Workload, mark_tensor_parallel, predict, trace_layers
from hpcpar.run.workloads.graph import make_graph_file

__all__ = ["workload_from_job", "workload_of", "fit_points", "LEVERS", "Largest",
           "largest_samples", "dataset_note"]


def _sample_shape(job) -> tuple[tuple, int]:
    """(per-sample x shape (C, D, H, W), number of targets): the job's [data] size and
    channels win (``--set data.size=`` plans that size even where a dataset of another size
    sits at ``data.path``: :func:`dataset_note` says so), the rest from the dataset's
    manifest, else the synthetic generator's defaults."""
    from hpcpar.data.synthetic import TARGETS  # deferred: loads numpy

    d = job.data.params
    m = _manifest(job)
    channels = d.get("channels") or (m.x.shape[0] if m else 4)
    targets = int(m.y.shape[0]) if m else len(TARGETS)
    if d.get("size"):
        return (channels,) + (d["size"],) * 3, targets
    if m:
        return (channels, *m.x.shape[1:]), targets
    raise ConfigError(f"{job.name}: [data] size is not set and no dataset manifest to read it "
                      "from; add --set data.size=N")


def _manifest(job):
    """The manifest of the volume dataset at [data] path, or None (no path, no dataset yet,
    or a sharded graph: its manifest is read by :func:`_graph_workload`)."""
    from hpcpar.graph.shards import is_sharded_graph  # deferred: loads numpy

    path = job.data.params.get("path")
    if not path or not (Path(path) / "manifest.json").is_file() or is_sharded_graph(path):
        return None
    return read_manifest(path)


def dataset_note(path: str, overrides=()) -> str | None:
    """Why a run of the job as planned would not start as it is: the dataset at [data] path
    holds samples of another size than the [data] size planned for; one line, None when the
    dataset fits (or there is none yet)."""
    job = load_job(path, list(overrides))
    m, size = _manifest(job), job.data.params.get("size")
    if m is None or not size or tuple(m.x.shape[1:]) == (size,) * 3:
        return None
    have = "x".join(map(str, m.x.shape[1:]))
    return (f"planned for [data] size = {size}; the dataset at [data] path "
            f"{job.data.params['path']} holds {have} samples, so a run needs another "
            f"--set data.path=DIR (generated there) or that dataset's size")


def _model(job, sample_shape, n_targets):
    """The job's plain model on the meta device, built by its workload (no data, no memory),
    and the shape of its input (the sample without label channels)."""
    import torch

    cls = get_workload(job.model.kind)
    if not hasattr(cls, "build_plain"):
        raise ConfigError(f"[model] kind {job.model.kind!r}: the planner models volume jobs "
                          "(cosmoflow, unet3d) and full-graph GNN jobs (gcn, sage)")
    with torch.device("meta"):
        model = cls.build_plain(job, sample_shape[0], sample_shape[1:], n_targets)
    return model, (sample_shape[0] - cls.label_channels, *sample_shape[1:])


def _graph_parts(path: str, method: str, seed: int):
    """``ranks -> [Part]``: the graph file partitioned as the run partitions it (the same
    partitioner, seed and symmetry), then each part's owned vertices, in-edges, halo
    vertices and neighbouring parts counted."""
    import numpy as np

    from hpcpar.graph.format import GraphFile  # deferred: loads numpy
    from hpcpar.graph.vertex_partition import partition_csr  # deferred: loads numpy

    with GraphFile(path) as gf:
        indptr, indices = gf.read_structure()
        directed = gf.directed
    n = indptr.shape[0] - 1
    dest = np.repeat(np.arange(n), np.diff(indptr))

    def parts(ranks: int) -> list:
        owner = partition_csr(indptr, indices, ranks, method, seed, symmetric=not directed) \
            if ranks > 1 else np.zeros(n, np.int64)
        own_d, own_s = owner[dest], owner[indices]
        cross = own_d != own_s
        halo = np.bincount(np.unique(own_d[cross] * n + indices[cross]) // n, minlength=ranks)
        peers = np.bincount(np.unique(own_d[cross] * ranks + own_s[cross]) // ranks,
                            minlength=ranks)
        owned = np.bincount(owner, minlength=ranks)
        edges = np.bincount(own_d, minlength=ranks)
        return [Part(int(owned[r]), int(edges[r]), int(halo[r]), int(peers[r]))
                for r in range(ranks)]

    return parts


def _shard_parts(path: str, m) -> Callable[[int], list]:
    """``ranks -> [Part]`` of a sharded graph: its own parts (the run needs as many ranks),
    counted one part at a time from ``/indices`` read in chunks, so planning a graph larger
    than this machine holds needs only the largest halo in memory."""
    import numpy as np

    from hpcpar.graph.shards import RangeOwner, part_halo  # deferred: loads numpy

    owner = RangeOwner(m["offsets"])

    def parts(ranks: int) -> list:
        out = []
        for p in range(m["parts"]):
            edges, halo = part_halo(path, m, p)
            peers = len(np.unique(owner[halo]))
            out.append(Part(m["shards"][p]["count"], edges, int(halo.shape[0]), peers))
        return out

    return parts


def _graph_workload(job, cls):
    """The planner's view of a full-graph job: widths from the graph file (or a sharded
    graph's manifest) and [model]."""
    from hpcpar.graph.format import GraphFile  # deferred: loads numpy
    from hpcpar.graph.shards import is_sharded_graph, read_graph_manifest  # deferred: numpy

    if cls.conv not in ("gcn", "sage"):
        raise ConfigError(f"[model] kind {job.model.kind!r}: the planner models full-graph "
                          f"gcn and sage jobs, not {cls.conv}; plan a gcn job of the same "
                          f"widths for an estimate")
    d, m = job.data.params, job.model.params
    path = d["path"]
    if not os.path.exists(path):
        if not d["make"]:
            raise ConfigError(f"[data] path: {path!r}: graph file not found")
        make_graph_file(path, d)  # what the run makes first (Cora: a copy, synthetic: seconds)
    sharded = None
    if is_sharded_graph(path):   # partitioned ahead: [data] partition does not apply
        man = read_graph_manifest(path)
        features, classes, nodes = man["num_features"], man["num_classes"], man["num_nodes"]
        parts, sharded = _shard_parts(path, man), man["parts"]
    else:
        with GraphFile(path) as gf:
            features, classes, nodes = gf.num_features, gf.num_classes, gf.num_nodes
        parts = _graph_parts(path, d["partition"], d["partition_seed"])
    widths = (features, *[m["hidden"]] * (m["layers"] - 1), classes)
    graph = GraphJob(widths, cls.conv, m["dropout"], m["precompute"], parts, nodes, sharded)
    return Workload(job.name, [], (features,), 1, precision=job.train.precision,
                    optimizer=job.train.optimizer, params=graph.params, graph=graph)


def workload_from_job(path: str, overrides=(), size: int | None = None):
    """The planner's view of a job; ``size``: a cubic sample of that edge instead of the
    dataset's (the job's channels). Full-graph jobs (gcn, sage) read their graph file."""
    return workload_of(load_job(path, list(overrides)), size)


def workload_of(job, size: int | None = None):
    """The planner's view of a validated job (``JobSpec``); see :func:`workload_from_job`."""
    cls = get_workload(job.model.kind)
    if hasattr(cls, "conv") and not hasattr(cls, "build_plain"):
        return _graph_workload(job, cls)
    shape, n_targets = _sample_shape(job)
    if size is not None:
        shape = (shape[0], size, size, size)
    model, in_shape = _model(job, shape, n_targets)
    layers = trace_layers(model, in_shape, job.train.activation_checkpointing)
    if job.model.params.get("tensor_parallel"):
        mark_tensor_parallel(layers, job.model.params["tp_min_features"])
    ck = job.checkpoint
    return Workload(job.name, layers, shape, job.train.global_batch,
                    precision=job.train.precision, optimizer=job.train.optimizer,
                    checkpoints=bool(ck.every or ck.at_end),
                    shard_optimizer=job.train.shard_optimizer,
                    fuse_halos=job.model.fuse_halos,
                    input_copy=job.train.channels_last
                    or job.data.params.get("transform", "auto") != "none")


def fit_points(run_dirs, trust_kind: bool = False) -> list:
    """``(workload, grid, measured step)`` of finished runs, for :mod:`hpcpar.plan.fit`; a
    directory that is not a finished run is a one-line error. A run's ``[model] kind`` imports
    no code unless it is built in, already loaded by the job being planned, or ``trust_kind``
    (installed packages only)."""
    from hpcpar.analysis import load, scaling_table  # deferred: loads pandas, numpy

    points = []
    for rd in run_dirs:
        if not (Path(rd) / "job.json").is_file():
            raise ConfigError(f"--fit-on {rd}: no job.json there (not an hpcpar run directory)")
        job = load_resolved(Path(rd) / "job.json", untrusted=True, trust_kind=trust_kind)
        runs, steps = load([str(rd)])
        if steps.empty:
            raise ConfigError(f"--fit-on {rd}: no step records (the run has not trained)")
        scaled = scaling_table(runs, steps).iloc[0]
        grid = resolve_shape(job.grid_shape, int(scaled["ranks"]))
        points.append((workload_of(job), grid, float(scaled["t_step_median"])))
    return points


#: what a job can turn on to hold a larger sample: ``(--set, whether the job has it off)``
LEVERS = (
    ("train.activation_checkpointing=auto", lambda job: not job.train.activation_checkpointing),
    ("train.shard_optimizer=true", lambda job: not job.train.shard_optimizer),
    ("train.precision=bf16", lambda job: job.train.precision == "fp32"),
    ("model.tensor_parallel=false", lambda job: bool(job.model.params.get("tensor_parallel"))),
)


@dataclass(frozen=True)
class Largest:
    """The largest cubic sample of one grid: ``edge`` and ``mem_bytes`` None when none fits;
    ``lever`` the ``--set`` (one of :data:`LEVERS` this job has off) that would hold the
    largest one, ``lever_edge``, when one holds a larger one."""

    grid: str
    edge: int | None
    mem_bytes: float | None
    lever: str | None = None
    lever_edge: int | None = None


def largest_samples(job_file, sets, work, preds, machine) -> list[Largest]:
    """Per grid the largest cubic sample edge (the job's channels and batch) whose
    predicted peak memory per rank fits the machine's ``mem_per_rank``, with the levers the
    job enables, and the lever that would let a larger one fit. Largest first."""
    job = load_job(job_file, list(sets))
    works: dict[tuple, Workload | None] = {((), work.sample_shape[1]): work}

    def at(size, extra=()):
        if (extra, size) not in works:
            try:
                works[extra, size] = workload_from_job(job_file, [*sets, *extra], size=size)
            except (HpcparError, ValueError, RuntimeError):   # smaller than the model takes
                works[extra, size] = None   # (torch's own message, e.g. a batch norm of 1x1x1)
        return works[extra, size]

    def edge_of(grid, extra=()):
        def fits(size):
            w = at(size, extra)
            return estimate(w, grid, BYTES.get(w.precision, 4)).total <= \
                HEADROOM * machine.mem_per_rank

        return largest_edge(fits, smallest)

    smallest = next(s for s in range(1, 1 << 14) if at(s) is not None)
    levers = [(lever,) for lever, off in LEVERS if off(job)]
    out: list[Largest] = []
    for p in preds:
        if "not divisible" in p.reason:
            continue
        edge = edge_of(p.grid)
        best = predict(at(edge), p.grid, machine) if edge else None
        if best is None or not best.feasible:   # too small for this many ranks on an axis
            out.append(Largest(p.spec, None, None))
            continue
        row = Largest(p.spec, edge, best.mem_bytes)
        for extra in levers:
            more = edge_of(p.grid, extra)
            if more and more > (row.lever_edge or edge):
                row = dataclasses.replace(row, lever=extra[0], lever_edge=more)
        out.append(row)
    return sorted(out, key=lambda r: (-(r.edge or 0), r.grid))
