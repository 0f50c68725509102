"""``[train] precision = "fp16"``: dynamic loss scaling whose every decision all ranks share.

fp16 gradients underflow unless the loss is scaled up before backward; too large a scale
overflows them. torch's ``GradScaler`` keeps the overflow flag per device and steps the
optimizer on its own finding, so two ranks could disagree on whether a step happened (their
replicas drift apart) and on the next scale. Here the scaler only does the arithmetic: the
training loop checks the unscaled, synced gradients, adds the flag to its one per-step
allreduce, and calls :meth:`LossScaler.update` with the agreed flag on every rank, so the
scale and the skip are the same everywhere. The rule and the defaults are ``GradScaler``'s
(start 2^16, halve on overflow, double after 2000 overflow-free steps) and
:meth:`~LossScaler.state_dict` uses its keys, so a checkpoint resumes bit-identically. Scales
stay powers of two: scaling and unscaling are exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

__all__ = ["LossScaler", "MIN_SCALE"]

#: Below this scale every fp16 gradient would be zero (2^-24 is fp16's smallest step): a
#: gradient still non-finite there is not an overflow the scale can cure, it is divergence.
MIN_SCALE = 2.0 ** -24
#: float32's largest value: ``GradScaler`` keeps the scale in float32 and never grows past it.
_FP32_MAX = 3.4028234663852886e38


class LossScaler:
    """The scale of one run: multiply the loss by it before backward, divide the gradients
    by it after the sync, then :meth:`update` with the overflow flag all ranks agreed on.
    The scale is multiplied by ``growth_factor`` after ``growth_interval`` good steps in a row,
    by ``backoff_factor`` on an overflow."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.growth_tracker = 0         # good steps since the last change of scale

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward()`` on."""
        return loss * self.scale

    def unscale_(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Divide every gradient of ``params`` by the scale, in place (exact: a power of two;
        inf and NaN stay what they are, for the finiteness check that follows)."""
        import torch

        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, found_inf: bool) -> None:
        """Next step's scale, from the flag every rank agreed on (``GradScaler.update``'s
        rule): back off and restart the count on an overflow, else grow after
        ``growth_interval`` good steps unless the scale would leave float32."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = self.scale * self.growth_factor
            if grown <= _FP32_MAX:
                self.scale = grown
            self.growth_tracker = 0

    @property
    def exhausted(self) -> bool:
        """The scale fell below :data:`MIN_SCALE`: overflows no longer come from the scale."""
        return self.scale < MIN_SCALE

    def state_dict(self) -> dict:
        """What a checkpoint keeps (``GradScaler.state_dict``'s keys)."""
        return {"scale": self.scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` (or a ``GradScaler.state_dict()``)."""
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.growth_tracker = int(state["_growth_tracker"])
