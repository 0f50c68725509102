"""The examples every ``--help`` ends with, one table for all commands (click epilogs).

Kept apart from the command modules so that every command, whoever owns its module, gets its
examples the same way: :class:`hpcpar.cli.main.LazyGroup` attaches them when it loads a command. A
command path missing here fails tests/cli/test_cli_conventions.py."""

from __future__ import annotations

import click

__all__ = ["epilog", "attach"]

# "command path" -> example command lines (shown verbatim, not re-wrapped)
EXAMPLES: dict[str, tuple[str, ...]] = {
    "": ("hpcpar run jobs/demo-cosmoflow.toml -n 4",
         "hpcpar report runs/demo-cosmoflow",
         "hpcpar COMMAND --help"),
    "run": ("hpcpar run jobs/demo-cosmoflow.toml                   # 4 ranks, 2 data x 2 spatial",
            "hpcpar run jobs/demo-cosmoflow.toml -n 2 --grid 1x2x1x1 --set train.steps=20",
            "hpcpar run jobs/demo-cosmoflow.toml --print-config     # resolved job as TOML",
            "RUN=$(hpcpar run job.toml) && hpcpar report \"$RUN\""),
    "sweep": ("hpcpar sweep jobs/demo-cosmoflow.toml --ranks 1,2,4 --out sweeps/demo",
              "hpcpar sweep job.toml --ranks 1,2,4 --out sweeps/weak --weak"),
    "report": ("hpcpar report sweeps/demo -o report",
               "hpcpar report --compare sweeps/before sweeps/after -o compare"),
    "submit": ("hpcpar submit jobs/cosmoflow-128.toml -o sweeps/c128 --site perlmutter "
               "--ranks 4,8,16 --report",
               "hpcpar submit job.toml -o sub --ranks 2 --dry-run"),
    "status": ("hpcpar status sweeps/c128", "hpcpar status sweeps/c128 --json"),
    "info": ("hpcpar info", "hpcpar info --json",
             "hpcpar info --ranks 8 --grid -1x2x2x1 --ranks-per-node 4"),
    "plan": ("hpcpar plan jobs/cosmoflow-512-spatial.toml -n 64 --machine perlmutter",
             "hpcpar plan job.toml -n 8 --json",
             "hpcpar plan --calibrate"),
    "predict": ("hpcpar predict runs/demo-unet3d --data volumes.h5 --out pred.h5 -n 2 --argmax",
                "hpcpar predict --model net.py:UNet --weights model.pt --data data/vol "
                "--out pred.h5 -n 4 --grid 1x2x2x1 --max-slab 64"),
    "schema": ("hpcpar schema > hpcpar-job.schema.json",
               "hpcpar schema --kind unet3d",
               "hpcpar schema --kind my_pkg.workload:MyWorkload -o schema.json"),
    "data": ("hpcpar data make cosmoflow data/c32 --samples 64 --size 32",
             "hpcpar data shard volumes.h5 data/mine --samples-per-shard 16",
             "hpcpar data verify data/mine"),
    "data make": ("hpcpar data make cosmoflow data/c32 --samples 64 --size 32",),
    "data make cosmoflow": ("hpcpar data make cosmoflow data/c32 --samples 64 --size 32",
                            "mpiexec -n 4 hpcpar data make cosmoflow data/c128 --samples 512 "
                            "--size 128 --chunk grid:2x2x1"),
    "data shard": ("hpcpar data shard volumes.h5 data/mine --samples-per-shard 16",
                   "hpcpar data shard raw.h5 data/logged --x-key image --y-key target "
                   "--samples-per-shard 8 --transform log1p"),
    "data info": ("hpcpar data info data/c32",),
    "data verify": ("hpcpar data verify data/c32", "hpcpar data verify data/c32 --no-checksum"),
    "data graph": ("hpcpar data graph import cora data/cora.h5",
                   "hpcpar data graph make data/g.npz --nodes 100000"),
    "data graph import": ("hpcpar data graph import cora data/cora.h5",
                          "hpcpar data graph import pyg_data.pt data/g.h5      # torch.save(data)",
                          "hpcpar data graph import edges.txt data/g.h5 --features x.npy "
                          "--labels y.npy --split 0.6,0.2"),
    "data graph make": ("hpcpar data graph make data/g.npz --nodes 100000 --avg-degree 10",),
    "data graph partition": ("hpcpar data graph partition data/cora.h5 data/cora-4 --parts 4",
                             "hpcpar data graph partition edges.txt data/g-64 --parts 64 "
                             "--method stream --features x.npy"),
}


def epilog(path: str) -> str | None:
    """The ``Examples:`` epilog of command ``path`` (its words after ``hpcpar``, e.g. ``"data
    shard"``), with click's no-rewrap marker; None when there are no examples."""
    lines = EXAMPLES.get(path)
    if not lines:
        return None
    return "Examples:\n\n\b\n" + "\n".join(f"  {line}" for line in lines)


def attach(cmd: click.Command, path: str) -> click.Command:
    """Give ``cmd`` (at ``path``) and its sub-commands (groups) their examples, unless they have an
    epilog; returns ``cmd``."""
    if cmd.epilog is None:
        cmd.epilog = epilog(path)
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            attach(sub, f"{path} {name}".strip())
    return cmd
