"""The largest sample that trains under a real per-rank memory limit (issue 29, item 7).

For each configuration, bisects the largest cubic edge (a multiple of ``--step``) at which
two training steps of the job (global batch 1) finish with every rank inside its own memory
cgroup of ``--limit`` bytes (``hpcpar.testing.memlimit``: what Slurm's ``--mem-per-cpu``
enforces); exit code 6 (the kernel's limit killed a rank) means "does not fit". The
configurations:

* ``torch``: the job's plain model in one process, Adam, MSE on random targets;
* ``torch+ckpt``: the same with ``torch.utils.checkpoint`` (every ``nn.Sequential`` child in
  sqrt(len) segments, every other child whole): what a user of plain torch does first;
* ``hpcpar N lever``: ``hpcpar run JOB -n N`` on the all-spatial grid of N ranks, with
  each lever (``--levers``: ``--set`` strings; a lever the job schema does not know is
  reported and skipped).

Printed per configuration: the measured edge, its voxels relative to plain torch (and to
torch with checkpointing), and the planner's largest edge for the same limit and grid
(``hpcpar plan --memory-budget``) beside it. The datasets are written once per edge under
``--work`` (two samples, outside the limit) and removed after.

    python benchmarks/largest_sample.py                         # CosmoFlow demo, 1.5 GiB
    python benchmarks/largest_sample.py --job jobs/demo-unet3d.toml --ranks 1,2,4
    python benchmarks/largest_sample.py --limit 768MiB --ranks 1,8 --levers none

Needs root and a cgroup v1 memory controller. Ranks are oversubscribed (8 ranks on 2 cores
here): only memory is measured, never time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hpcpar.launch.allocator import preload

EXIT_OOM = 6     # hpcpar.errors.EXIT_OUT_OF_MEMORY
STEPS = 2


def spatial_grid(n: int) -> str:
    """The all-spatial grid of ``n`` ranks with the most even split (x >= y >= z)."""
    best = None
    for x in range(1, n + 1):
        for y in range(1, n // x + 1):
            if n % (x * y) == 0:
                z = n // (x * y)
                if x >= y >= z:
                    key = max(x, y, z) - min(x, y, z)
                    best = min(best or (key, x, y, z), (key, x, y, z))
    _, x, y, z = best
    return f"1x{x}x{y}x{z}"


def common_sets(job: dict, edge: int, data_dir: str) -> list[str]:
    """``--set`` strings for two steps of batch 1 on the dataset of ``edge`` at ``data_dir``."""
    return [f"data.path={data_dir}", "data.source=hdf5", "data.generate=false",
            f"data.size={edge}", "data.samples=2", "data.val_samples=0",
            "train.global_batch=1", f"train.steps={STEPS}", "train.warmup_steps=0",
            "train.val_every=0", "checkpoint.every=0"]


def make_dataset(edge: int, channels: int, out: str) -> None:
    subprocess.run(["hpcpar", "data", "make", "cosmoflow", out, "--samples", "2", "--size",
                    str(edge), "--channels", str(channels), "--shards", "1", "--quiet",
                    "--force"], check=True, stdout=subprocess.DEVNULL)


class Trial:
    """Runs one configuration at one edge under the limit; caches datasets by edge."""

    def __init__(self, args, channels: int):
        self.args, self.channels = args, channels
        self.wrapper = Path(args.work) / "mpiexec-limited"
        self.limit = f"{args.limit}"
        subprocess.run([sys.executable, "-m", "hpcpar.testing.memlimit", "--limit", self.limit,
                        "--write-mpiexec", str(self.wrapper)], check=True)
        self.data: dict[int, str] = {}

    def dataset(self, edge: int) -> str:
        if edge not in self.data:
            out = str(Path(self.args.work) / f"data-{edge}")
            make_dataset(edge, self.channels, out)
            self.data[edge] = out
        return self.data[edge]

    def fits(self, config: tuple, edge: int) -> bool:
        kind, ranks, lever = config
        data = self.dataset(edge)
        run_dir = str(Path(self.args.work) / "run")
        shutil.rmtree(run_dir, ignore_errors=True)
        limited = [sys.executable, "-m", "hpcpar.testing.memlimit", "--limit", self.limit, "--"]
        if kind == "hpcpar":
            sets = common_sets({}, edge, data) + ([] if lever == "none" else [lever])
            cmd = ["hpcpar", "run", self.args.job, "-n", str(ranks), "--grid",
                   spatial_grid(ranks), "--run-dir", run_dir,
                   *[a for s in sets for a in ("--set", s)]]
            env = dict(os.environ, HPCPAR_MPIEXEC=str(self.wrapper))
            if ranks == 1:
                cmd = limited + cmd
        else:
            cmd = limited + [sys.executable, __file__, "--child-torch", str(edge), "--job",
                             self.args.job] + (["--checkpoint"] if kind == "torch+ckpt" else [])
            env = dict(os.environ)
            preload(env)   # the allocator hpcpar run gives its ranks: a like-for-like peak
        env.setdefault("OMP_NUM_THREADS", "1")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        return completed(proc, f"{config} at edge {edge}")


def completed(proc: subprocess.CompletedProcess, what: str) -> bool:
    """Whether a limited process completed (True) or the memory limit killed it (False); any
    other failure raises, naming ``what``."""
    if proc.returncode == 0:
        return True
    if proc.returncode in (EXIT_OOM, 128 + 9, -9) or "killed by the memory limit" in (
            proc.stderr + proc.stdout):   # a rank in its own group (mpiexec stand-in)
        return False
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    raise RuntimeError(f"{what}: exit {proc.returncode}: " + " | ".join(tail))


def largest(trial: Trial, config: tuple, guess: int | None, step: int, hi: int) -> int | None:
    """Largest multiple of ``step`` in [step, hi] that fits: start at the guess (a planner's guess
    past ``hi`` starts at ``hi``, so no edge above it is reported), walk by doubling the stride to
    bracket, then bisect (each size is a multiple of ``step``)."""
    start = min(hi // step * step, max(step, (guess or 4 * step) // step * step))
    ok, bad = (start, None) if trial.fits(config, start) else (None, start)
    stride = step
    while ok is None or bad is None:
        probe = (ok + stride) if ok is not None else (bad - stride)
        if probe < step:
            return None
        if probe > hi:
            bad = hi + step
            break
        if trial.fits(config, probe):
            ok = probe
        else:
            bad = probe
        stride *= 2
    while bad - ok > step:
        mid = (ok + bad) // 2 // step * step
        if mid in (ok, bad):
            break
        ok, bad = (mid, bad) if trial.fits(config, mid) else (ok, mid)
    return ok


def planned(job: str, ranks: int, limit: str, lever: str) -> int | None:
    """The planner's largest edge for the all-spatial grid of ``ranks`` under ``limit``."""
    sets = ["train.global_batch=1"] + ([] if lever == "none" else [lever])
    out = subprocess.run(["hpcpar", "plan", job, "-n", str(ranks), "--memory-budget", limit,
                          "--json", *[a for s in sets for a in ("--set", s)]],
                         capture_output=True, text=True)
    if out.returncode:
        return None
    grid = spatial_grid(ranks)
    for row in json.loads(out.stdout).get("largest_samples") or []:
        if row["grid"] == grid:
            return row["edge"]
    return None


def lever_known(job: str, lever: str) -> bool:
    if lever == "none":
        return True
    out = subprocess.run(["hpcpar", "run", job, "-n", "1", "--grid", "1x1x1x1", "--dry-run",
                          "--set", lever], capture_output=True, text=True)
    return out.returncode == 0


def child_torch(edge: int, job_file: str, checkpoint: bool) -> int:
    """Two Adam steps of the job's plain model on one random sample of ``edge`` (batch 1)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint as ckpt
    from torch.utils.checkpoint import checkpoint_sequential

    from hpcpar.formats.jobspec import load_job
    from hpcpar.formats.kinds import get_workload

    torch.manual_seed(0)
    job = load_job(job_file, [f"data.size={edge}"])
    cls = get_workload(job.model.kind)
    channels = job.data.params.get("channels") or 4
    model = cls.build_plain(job, channels, (edge,) * 3, 4)
    if checkpoint:
        for child in list(model.children()):
            if not any(p.requires_grad for p in child.parameters()):
                continue
            if isinstance(child, torch.nn.Sequential) and len(child) > 1:
                seg = max(1, round(math.sqrt(len(child))))
                child.forward = (lambda x, c=child, s=seg:   # type: ignore[method-assign]
                                 checkpoint_sequential(c, s, x, use_reentrant=False))
            else:
                plain = child.forward
                child.forward = (lambda *a, f=plain, **k:   # type: ignore[method-assign]
                                 ckpt(f, *a, use_reentrant=False, **k))
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(1, channels - cls.label_channels, edge, edge, edge)
    for _ in range(STEPS):
        out = model(x)
        loss = F.mse_loss(out, torch.zeros_like(out))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default="jobs/demo-cosmoflow.toml")
    ap.add_argument("--limit", default="1.5GiB", help="memory per rank (and per torch process)")
    ap.add_argument("--ranks", default="1,2,4,8")
    ap.add_argument("--levers", default="none,train.shard_optimizer=true,"
                    "train.activation_checkpointing=auto",
                    help="comma-separated --set strings ('none': the job as it is)")
    ap.add_argument("--step", type=int, default=8, help="edges are multiples of this")
    ap.add_argument("--max-edge", type=int, default=512)
    ap.add_argument("--no-torch", action="store_true", help="skip the plain torch rows")
    ap.add_argument("--work", help="scratch directory (default: a new temporary one)")
    ap.add_argument("--child-torch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_torch:
        return child_torch(args.child_torch, args.job, args.checkpoint)

    from hpcpar.formats.jobspec import load_job
    from hpcpar.formats.kinds import get_workload
    from hpcpar.testing.memlimit import available

    why = available()
    if why:
        print(f"largest_sample: {why}", file=sys.stderr)
        return 2
    job = load_job(args.job, [])
    channels = job.data.params.get("channels") or 4
    if get_workload(job.model.kind).label_channels and channels < 2:
        channels = 2
    levers = [lv for lv in args.levers.split(",") if lv]
    for lv in levers:
        if not lever_known(args.job, lv):
            print(f"lever {lv}: not known to this checkout's job schema; skipped")
    levers = [lv for lv in levers if lever_known(args.job, lv)]
    configs = [] if args.no_torch else [("torch", 1, "none"), ("torch+ckpt", 1, "none")]
    configs += [("hpcpar", int(n), lv) for n in args.ranks.split(",") for lv in levers]
    print(f"# {' '.join(sys.argv)}\n# job {args.job}, {args.limit} per rank, batch 1, "
          f"{STEPS} steps, edges in multiples of {args.step}")
    given = args.work is not None
    work = args.work = args.work or tempfile.mkdtemp(prefix="hpcpar-largest-")
    os.makedirs(work, exist_ok=True)
    rows = []
    try:
        trial = Trial(args, channels)
        for config in configs:
            kind, ranks, lever = config
            pred = planned(args.job, ranks, args.limit, lever) if kind == "hpcpar" else None
            edge = largest(trial, config, pred or (rows[-1][3] if rows else None),
                           args.step, args.max_edge)
            rows.append((kind, ranks, lever, edge, pred))
            print(f"  {kind:<10} {ranks:>2} {lever:<40} edge {edge}  planner {pred}",
                  flush=True)
            for e in [e for e in trial.data if e != edge]:   # keep disk use bounded
                shutil.rmtree(trial.data.pop(e), ignore_errors=True)
    finally:
        if not given:
            shutil.rmtree(work, ignore_errors=True)
    base = {k: e for k, n, _, e, _ in rows if k.startswith("torch")}
    print("\n| config | ranks | lever | largest edge | voxels / torch | voxels / torch+ckpt "
          "| planner edge |\n| --- | --- | --- | --- | --- | --- | --- |")
    for kind, ranks, lever, edge, pred in rows:
        rel = [f"{(edge / base[b]) ** 3:.2f}" if edge and base.get(b) else "-"
               for b in ("torch", "torch+ckpt")]
        print(f"| {kind} | {ranks} | {lever} | {edge or '-'} | {rel[0]} | {rel[1]} | "
              f"{pred or '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
