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
[intra]                        # between ranks of one node
alpha = 3e-6                  # latency per message, s
beta = 80e9                   # bandwidth per direction, bytes/s
[inter]                        # between nodes (per rank's share of the NICs)
alpha = 4e-6
beta = 20e9
```
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import HpcparError


class MachineError(HpcparError):
    pass


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per message
    beta: float   # bytes per second

    def time(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.alpha + nbytes / self.beta


@dataclass(frozen=True)
class Machine:
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

    def compute_share(self, ranks_on_node: int) -> float:
        """Fraction of a core each rank gets (1 unless the node is oversubscribed)."""
        cores = self.cores or self.ranks_per_node
        return min(1.0, cores / max(1, ranks_on_node))

    def to_toml(self) -> str:
        d = asdict(self)
        lines = [f'name = "{self.name}"', f'description = "{self.description}"']
        for k in ("ranks_per_node", "cores", "flops", "mem_bw", "mem_per_rank", "io_bw"):
            lines.append(f"{k} = {d[k]!r}")
        for sec in ("intra", "inter"):
            lines += ["", f"[{sec}]", f"alpha = {d[sec]['alpha']!r}", f"beta = {d[sec]['beta']!r}"]
        return "\n".join(lines) + "\n"


REQUIRED = {"ranks_per_node": int, "flops": float, "mem_bw": float, "mem_per_rank": float,
            "io_bw": float}


def machines_dir() -> Path:
    """``HPCPAR_MACHINES``, else ``machines/`` of hpcpar's slurm data (installed package data
    or the source checkout's ``slurm/``)."""
    env = os.environ.get("HPCPAR_MACHINES")
    if env:
        return Path(env)
    from .site import data_dirs

    dirs = [d / "machines" for d in data_dirs()]
    return next((d for d in dirs if d.is_dir()), dirs[-1] if dirs else Path("slurm/machines"))


def load_machine(name_or_path: str) -> Machine:
    """Load a machine by file path or by name in :func:`machines_dir`."""
    path = Path(name_or_path)
    if not path.suffix:
        path = machines_dir() / f"{name_or_path}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in machines_dir().glob("*.toml"))
        raise MachineError(f"machine file {path}: not found (known machines: "
                           f"{', '.join(known) or 'none'})")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise MachineError(f"machine file {path}: not valid TOML ({exc})") from None
    for key, typ in REQUIRED.items():
        if key not in raw:
            raise MachineError(f"machine file {path}: missing key {key!r}")
        if not isinstance(raw[key], (int, float)) or raw[key] <= 0:
            raise MachineError(f"machine file {path}: {key} must be a positive number")
    links = {}
    for sec in ("intra", "inter"):
        s = raw.get(sec)
        if not isinstance(s, dict) or not {"alpha", "beta"} <= set(s):
            raise MachineError(f"machine file {path}: section [{sec}] needs alpha and beta")
        links[sec] = Link(float(s["alpha"]), float(s["beta"]))
    return Machine(name=str(raw.get("name", path.stem)), ranks_per_node=int(raw["ranks_per_node"]),
                   flops=float(raw["flops"]), mem_bw=float(raw["mem_bw"]),
                   mem_per_rank=float(raw["mem_per_rank"]), io_bw=float(raw["io_bw"]),
                   intra=links["intra"], inter=links["inter"],
                   description=str(raw.get("description", "")), cores=int(raw.get("cores", 0)))
