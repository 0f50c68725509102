"""The loss and validation histories as a checkpoint's ``trainer.pt`` holds them: packed
into float64 tensors (:class:`PackedHistory`) and read back as lists (:func:`history_rows`).
torch is imported only when a history is packed or read, so the records stay plain Python.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PackedHistory", "history_rows"]


class PackedHistory:
    """A history as a checkpoint holds it: the loss history's [step, loss] pairs as an (N, 2)
    float64 tensor, the validation history's ``{"step": s, "val_loss": v, ...}`` records as
    ``{"columns": [...], "rows": (N, K) tensor}``. torch.save pickles a list item by item
    through a Python callback: 15 ms a checkpoint at 10,000 log points, growing with the run;
    a tensor is one record. The rows converted for an earlier checkpoint are kept, so each
    converts only the new ones. Steps (ints) and Python floats are exact in float64; a
    history holding anything else (an int metric, another set of keys) stays a list."""

    def __init__(self):
        self.rows: Any = None
        self.columns: tuple | None = None

    def __call__(self, history: list) -> Any:
        """What a checkpoint holds for ``history``, a list that only grows (else it is
        converted anew)."""
        import torch

        columns = _columns(history[0]) if history else None
        done = 0 if self.rows is None or columns != self.columns else self.rows.shape[0]
        if done > len(history):
            done = 0
        new = [_row(h, columns) for h in history[done:]]
        if columns == () or any(r is None for r in new):
            self.rows, self.columns = None, None
            return history
        width = 2 if columns is None else len(columns)
        new_rows = torch.tensor(new, dtype=torch.float64).reshape(-1, width)
        self.rows = new_rows if not done else torch.cat([self.rows, new_rows])
        self.columns = columns
        return self.rows if columns is None else {"columns": list(columns), "rows": self.rows}


def _columns(first: Any) -> tuple | None:
    """A history's kind from its first entry: None for [step, loss] pairs, the keys of
    ``{"step": ...}`` records, () for anything else."""
    if isinstance(first, dict):
        return tuple(first) if first and next(iter(first)) == "step" else ()
    return None if isinstance(first, (list, tuple)) else ()


def _row(entry: Any, columns: tuple | None) -> list | None:
    """One entry as numbers, or None when float64 would not give it back as it was."""
    if columns is None:
        values = list(entry) if isinstance(entry, (list, tuple)) and len(entry) == 2 else None
    elif isinstance(entry, dict) and columns and tuple(entry) == columns:
        values = [entry[c] for c in columns]
    else:
        return None
    if values is None or type(values[0]) is not int or abs(values[0]) > 2 ** 53 or \
            not all(isinstance(v, float) for v in values[1:]):   # numpy's float64 too
        return None
    return values


def history_rows(saved: Any) -> list:
    """A history back from a trainer state: the [step, loss] pairs or the records of
    :class:`PackedHistory`, steps as ints; a list (checkpoints before 2026-12, or a history
    that stayed one) as it is; anything else (an edited file) gives no rows."""
    import torch

    if isinstance(saved, dict) and isinstance(saved.get("columns"), list):
        columns, rows = saved["columns"], history_rows(saved.get("rows"))
        if not columns or columns[0] != "step" or any(len(r) != len(columns) for r in rows):
            return []
        return [dict(zip(columns, r)) for r in rows]
    if isinstance(saved, torch.Tensor):
        if saved.dim() != 2 or not saved.shape[1] or not saved.is_floating_point():
            return []
        return [[int(r[0]), *r[1:]] for r in saved.tolist()]
    return [list(h) if isinstance(h, tuple) else h for h in saved] \
        if isinstance(saved, (list, tuple)) else []
