"""Losses and metrics by name (``[train] loss``, ``[train] metrics``) for users' own models.

Each is plain torch on the model's output and the target. On a spatialized model the output
and a per-voxel target are split tensors, whose means and sums the dispatch makes the GLOBAL
ones (:mod:`hpcpar.nn.optable`): a loss is the single-process loss on every rank, its gradient
each rank's exact piece. Metrics are kept as sums (:class:`MetricSums`) over the batches and
the data-parallel replicas, so the value is the single-process value over the whole set, not
a mean of per-batch or per-rank values.

Targets: ``(N, D, H, W)`` class labels (a label volume), or ``(N, K)`` per-sample targets
(``K = 1`` class index for ``ce``). A one-channel output with ``bce``/``dice`` is binary
(sigmoid); more channels are class scores (softmax).

No torch import at module import (job validation runs in the launcher).
"""

from __future__ import annotations

from collections.abc import Callable

from hpcpar.errors import ConfigError

__all__ = ["check_loss", "check_metrics", "like", "make_loss", "MetricSums"]

#: the built-in losses; ``dice+ce`` is their sum
LOSSES = ("ce", "dice", "dice+ce", "mse", "bce", "l1")
#: the built-in metrics (dice: mean over foreground classes of 2|P∩T| / (|P| + |T|) over
#: every voxel of the set)
METRICS = ("dice", "accuracy", "mae", "mse")

_EPS = 1e-6


def check_loss(name: str) -> None:
    """ConfigError unless ``name`` is a built-in loss or a ``module:callable`` path."""
    if name not in LOSSES and ":" not in name:
        raise ConfigError(f"[train] loss: {name!r} is not one of {', '.join(LOSSES)} or "
                          f"'module:callable'")


def check_metrics(names) -> None:
    """ConfigError unless every name is a built-in metric."""
    for name in names:
        if name not in METRICS:
            raise ConfigError(f"[train] metrics: {name!r} is not one of {', '.join(METRICS)}")


def _classes(out, target):
    """Class labels ``(N, ...)`` from a label volume or a ``(N, 1)`` per-sample target."""
    return target[:, 0].long() if target.dim() == 2 and out.dim() == 2 else target.long()


def _onehot(labels, channels: int, dtype):
    """``(N, C, ...)`` of 0/1 from labels ``(N, ...)`` (one channel: the labels themselves)."""
    import torch

    if channels == 1:
        return labels.unsqueeze(1).to(dtype)
    classes = torch.arange(channels, device=labels.device)
    return (labels.unsqueeze(1) == classes.view(1, channels, *[1] * (labels.dim() - 1))
            ).to(dtype)


def like(out, target):
    """A float target shaped like ``out``: a label volume ``(N, D, H, W)`` gains the channel
    dim of a one-channel output; per-sample targets are reshaped."""
    target = target.float()
    return (target.unsqueeze(1) if out.dim() == 5 and target.dim() == 4
            else target.reshape(out.shape))


def _valid(labels, ignore_index):
    """1 where the label counts, 0 at ``ignore_index`` (``(N, 1, ...)``), or None."""
    return None if ignore_index is None else (labels != ignore_index).unsqueeze(1).float()


def dice_loss(out, labels, ignore_index=None):
    """1 - soft Dice, averaged over samples and channels (each sample's sums over its
    voxels): a mean over samples, so data-parallel replicas average to the global value."""
    probs = out.float().sigmoid() if out.shape[1] == 1 else out.float().softmax(1)
    valid = _valid(labels, ignore_index)
    if valid is not None:
        labels = labels * valid[:, 0].long()
    onehot = _onehot(labels, out.shape[1], probs.dtype)
    if valid is not None:
        probs, onehot = probs * valid, onehot * valid
    dims = tuple(range(2, out.dim()))
    inter = (probs * onehot).sum(dim=dims)
    total = probs.sum(dim=dims) + onehot.sum(dim=dims)
    return 1 - ((2 * inter + _EPS) / (total + _EPS)).mean()


def make_loss(name: str, weights=None, ignore_index=None) -> Callable:
    """``loss(output, target)`` for ``[train] loss``; ``weights`` (class weights) and
    ``ignore_index`` where torch's loss has them (``ce``, ``dice+ce``; ``ignore_index`` also
    masks ``dice``)."""
    import torch
    import torch.nn.functional as F

    def ce(out, target):
        w = None if weights is None else torch.tensor(weights, dtype=torch.float32,
                                                      device=out.device)
        kw = {} if ignore_index is None else {"ignore_index": ignore_index}
        return F.cross_entropy(out.float(), _classes(out, target), weight=w, **kw)

    def dice(out, target):
        return dice_loss(out, _classes(out, target), ignore_index)

    def regression(f):
        return lambda out, target: f(out.float(), like(out, target))

    def bce(out, target):
        pos = None if weights is None else torch.tensor(weights, dtype=torch.float32,
                                                        device=out.device)
        return F.binary_cross_entropy_with_logits(out.float(), like(out, target),
                                                  pos_weight=pos)

    table = {"ce": ce, "dice": dice, "dice+ce": lambda o, t: dice(o, t) + ce(o, t),
             "mse": regression(F.mse_loss), "l1": regression(F.l1_loss), "bce": bce}
    if name in table:
        return table[name]
    from hpcpar.formats.kinds import load_object  # deferred: imports the user's module

    return load_object(name, "[train] loss")


class MetricSums:
    """Running sums of each metric over batches; ``values(comm)`` adds them over the
    data-parallel replicas and returns each metric's value over the whole set."""

    def __init__(self, names, ignore_index=None):
        self.names = list(names)
        self.ignore_index = ignore_index
        self.sums: dict[str, list[float]] = {}

    def _add(self, name: str, parts) -> None:
        got = [float(p) for p in parts]
        old = self.sums.get(name)
        self.sums[name] = got if old is None else [a + b for a, b in zip(old, got)]

    def update(self, out, target) -> None:
        """Add one batch: ``out`` the model's output, ``target`` as the loss takes it."""
        import torch

        out = out.detach().float()
        for name in self.names:
            if name in ("mae", "mse"):
                diff = out - like(out, target)
                err = diff.abs() if name == "mae" else diff * diff
                self._add(name, (err.sum(), err.numel()))
                continue
            labels = _classes(out, target)
            pred = (out[:, 0] > 0).long() if out.shape[1] == 1 else out.max(1).indices
            keep = None if self.ignore_index is None else (labels != self.ignore_index)
            if name == "accuracy":
                hit = (pred == labels).float()
                if keep is None:
                    self._add(name, (hit.sum(), hit.numel()))
                else:
                    self._add(name, ((hit * keep.float()).sum(), keep.float().sum()))
                continue
            channels = max(2, out.shape[1])
            p = _onehot(pred, channels, torch.float64)
            t = _onehot(labels, channels, torch.float64)
            if keep is not None:
                p, t = p * keep.unsqueeze(1), t * keep.unsqueeze(1)
            dims = (0, *range(2, p.dim()))
            inter, total = (p * t).sum(dim=dims), p.sum(dim=dims) + t.sum(dim=dims)
            self._add(name, [*inter[1:].tolist(), *total[1:].tolist()])

    def values(self, comm=None) -> dict[str, float]:
        """Metric -> value over every batch added (and every replica of ``comm``)."""
        import numpy as np

        out = {}
        for name in self.names:
            sums = np.asarray(self.sums.get(name, [0.0, 0.0]), dtype=np.float64)
            if comm is not None:
                from mpi4py import MPI

                sums = comm.allreduce(sums, op=MPI.SUM)
            if name == "dice":
                k = len(sums) // 2
                inter, total = sums[:k], sums[k:]
                out[name] = float(np.mean(np.where(total > 0, 2 * inter / np.maximum(total, 1),
                                                   1.0)))
            else:
                out[name] = float(sums[0] / max(sums[1], 1))
        return out
