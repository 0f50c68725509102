"""``hpcpar data graph``: import, generate and partition graph files (HDF5).

Mounted under ``hpcpar data`` by hpcpar/cli/data.py. No numpy-heavy/torch/h5py imports at module
import time (``--help`` stays fast)."""

from __future__ import annotations

import os

import click

from hpcpar.graph.format import bundled, check_graph_out, import_npz, write_graph

__all__ = ["graph", "make", "partition"]


@click.group()
def graph():
    """Graph files for full-graph GNN training (one HDF5 file per graph)."""


def _split(ctx, param, value):
    try:
        a, b = (float(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected TRAIN,VAL fractions, e.g. 0.6,0.2") \
            from None
    return a, b


@graph.command("import")
@click.argument("source")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--features", type=click.Path(dir_okay=False), default=None,
              help="Edge lists: the (N, F) features, .npy or text (one row per vertex).")
@click.option("--labels", type=click.Path(dir_okay=False), default=None,
              help="Edge lists: the (N,) class ids, .npy or text (default: zeros).")
@click.option("--split", default="0.6,0.2", show_default=True, callback=_split,
              metavar="TRAIN,VAL",
              help="Random train/val fractions (rest test) where the source has no masks.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of --split.")
@click.option("--trust-pickle", is_flag=True,
              help="PyG files: unpickle classes beyond PyG's graph classes (this can run the "
                   "file's code: only for files you trust).")
@click.option("--force", is_flag=True, help="Replace OUT if it is a graph file hpcpar made.")
def import_(source, out, features, labels, split, seed, trust_pickle, force):
    """Convert a graph to OUT.h5: a Planetoid-style .npz (edge_index, CSR x, y, train/val/test_idx),
    a PyTorch Geometric Data saved with torch.save (.pt/.pth: edge_index, x, y, *_mask; loaded with
    weights_only=True and PyG's graph classes only, so the file's code never runs unless you pass
    --trust-pickle), or an edge list (text, one `src dst` per line) with --features.

    SOURCE may be a path or the name of a bundled dataset (``cora``)."""
    from hpcpar.graph.interop import import_graph  # deferred: keeps --help fast

    check_graph_out(out, force)
    if not os.path.exists(source) and os.path.exists(bundled(source.removesuffix(".npz"))):
        source = bundled(source.removesuffix(".npz"))
    if source.endswith(".npz"):
        s = import_npz(source, out)
    else:
        s = import_graph(source, out, features=features, labels=labels, split=split, seed=seed,
                         trust_pickle=trust_pickle)
    click.echo(f"wrote {out}: {s['nodes']} nodes, {s['edges']} edges, {s['features']} "
               f"features, {s['classes']} classes, {'directed' if s['directed'] else 'undirected'}"
               f"; train/val/test {s['train']}/{s['val']}/{s['test']}")


@graph.command("make")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--nodes", type=int, required=True, help="number of vertices")
@click.option("--avg-degree", type=float, default=10.0, show_default=True,
              help="mean in-degree")
@click.option("--communities", type=int, default=16, show_default=True)
@click.option("--features", type=int, default=32, show_default=True)
@click.option("--classes", type=int, default=4, show_default=True,
              help="labels = community % classes")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--directed", is_flag=True, help="one-way edges (default: both directions)")
@click.option("--p-in", type=float, default=0.85, show_default=True,
              help="fraction of edges inside a community")
@click.option("--signal", type=float, default=0.25, show_default=True,
              help="class signal in the features (lower: the graph matters more)")
@click.option("--force", is_flag=True, help="Replace OUT if it is a graph file hpcpar made.")
def make(out, nodes, avg_degree, communities, features, classes, seed, directed, p_in, signal,
         force):
    """Write a seeded power-law community graph with learnable labels to OUT.h5."""
    from hpcpar.graph.generate import power_law_community_graph  # deferred: keeps --help fast

    check_graph_out(out, force)
    g = power_law_community_graph(nodes, avg_degree, communities, features, classes, seed,
                                  directed=directed, p_in=p_in, signal=signal)
    write_graph(out, nodes, g["x"], g["y"], g["masks"], csr=(g["indptr"], g["indices"]),
                directed=directed, name=os.path.splitext(os.path.basename(out))[0],
                source=f"hpcpar data graph make --nodes {nodes} --avg-degree {avg_degree} "
                       f"--communities {communities} --features {features} --classes "
                       f"{classes} --seed {seed} --p-in {p_in} --signal {signal}"
                       f"{' --directed' if directed else ''}",
                num_classes=classes)
    click.echo(f"wrote {out}: {nodes} nodes, {g['indices'].shape[0]} edges, {features} "
               f"features, {classes} classes")


@graph.command("partition")
@click.argument("source")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--parts", type=int, required=True, help="Number of parts (the ranks to train on).")
@click.option("--method", type=click.Choice(["auto", "metis", "stream"]), default="auto",
              show_default=True,
              help="metis: whole structure in memory; stream: restreaming LDG over row blocks "
                   "(O(N) memory); auto: metis when its estimated memory fits half of "
                   "--memory-limit.")
@click.option("--memory-limit", default=None, metavar="BYTES",
              help="Memory auto may plan for (e.g. 8GiB; default: the available memory).")
@click.option("--passes", type=int, default=3, show_default=True,
              help="Streaming passes (stream).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of METIS.")
@click.option("--features", type=click.Path(dir_okay=False), default=None,
              help="Edge lists: the (N, F) features, .npy (read by rows) or text.")
@click.option("--labels", type=click.Path(dir_okay=False), default=None,
              help="Edge lists: the (N,) class ids, .npy or text (default: zeros).")
@click.option("--split", default="0.6,0.2", show_default=True, callback=_split,
              metavar="TRAIN,VAL", help="Edge lists: random train/val fractions (rest test).")
@click.option("--trust-pickle", is_flag=True, help="PyG files: as for `import`.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
def partition(source, out, parts, method, memory_limit, passes, seed, features, labels, split,
              trust_pickle, force):
    """Partition a graph into the sharded graph format OUT/ (one HDF5 file per part and a manifest
    with counts and sha256): SOURCE is an hpcpar graph file (.h5), a .npz, a PyG .pt or a text edge
    list (with --features). Prints the edge cut and the measured peak memory (ru_maxrss)."""
    from hpcpar._units import parse_bytes  # deferred: keeps --help fast
    from hpcpar.graph.stream_partition import partition_graph  # deferred: keeps --help fast

    if not os.path.exists(source) and os.path.exists(bundled(source.removesuffix(".npz"))):
        source = bundled(source.removesuffix(".npz"))
    limit = parse_bytes(memory_limit, "--memory-limit") if memory_limit else None
    m = partition_graph(source, out, parts, method, seed=seed, passes=passes, memory_limit=limit,
                        force=force, features=features, labels=labels, split=split,
                        trust_pickle=trust_pickle)
    p = m["partition"]
    click.echo(f"wrote {out}: {m['num_nodes']} nodes, {m['num_edges']} edges in {parts} parts "
               f"({p['method']}); edge cut {p['edge_cut']} ({100 * p['cut_fraction']:.1f}%), "
               f"load balance {p['balance']:.3f}; {p['seconds']:.1f} s, peak memory "
               f"{p['peak_rss_bytes'] / 2**20:.0f} MiB (ru_maxrss; METIS estimate "
               f"{p['metis_estimate_bytes'] / 2**20:.0f} MiB)")
