"""Full-graph GNN training over MPI: graph files, partitioning, halo plans, DistGraph.

``partition`` and the format/generator helpers need only numpy; ``DistGraph`` (torch) loads lazily.

May import: hpcpar.errors, hpcpar.parallel, hpcpar.sync (the stall detector around halo exchanges),
hpcpar.kernels, hpcpar.data (the sharded graph format checks its files with the volume format's
helpers)."""

from hpcpar.graph.vertex_partition import partition, partition_csr  # numpy only

from .._lazy import lazy_getattr

_LAZY = {
    "DistGraph": ("hpcpar.graph.distgraph", "DistGraph"),
    "GraphFile": ("hpcpar.graph.format", "GraphFile"),
    "write_graph": ("hpcpar.graph.format", "write_graph"),
    "import_npz": ("hpcpar.graph.format", "import_npz"),
    "power_law_community_graph": ("hpcpar.graph.generate", "power_law_community_graph"),
    "masked_loss": ("hpcpar.graph.metrics", "masked_loss"),
    "split_metrics": ("hpcpar.graph.metrics", "split_metrics"),
}


__getattr__ = lazy_getattr("hpcpar.graph", _LAZY)


__all__ = ["DistGraph", "GraphFile", "import_npz", "masked_loss", "partition",
           "partition_csr", "power_law_community_graph", "split_metrics", "write_graph"]
