"""Dynamic loss scaling for float16 compute (Micikevicius et al., "Mixed Precision Training",
ICLR 2018, section 3.2; the rule of ``jmp.DynamicLossScale`` and DeepSpeed's ``DynamicLossScaler``).

float16 gradients underflow below 6e-8: the loss is multiplied by a scale ``S`` before the
backward pass (``ChunkedStep(loss_scaling=True)(state, batch, loss_scale=S)``), the update
divides the gradients by ``S``, and a step whose scaled gradients overflowed (inf or NaN) changes
no state. The scale is explicit, immutable state that the caller keeps beside the train state:
after each step, ``scale = scale.adjust(finite)``: overflow halves it (never below
``min_scale``); ``growth_interval`` finite steps in a row double it.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """The loss scale and its counter (pure: :meth:`adjust` returns a new one).

    Attributes:
      scale: the current scale (float; powers of two keep unscaling exact). Default 2**15.
      counter: finite steps since the last change.
      growth_interval: finite steps in a row before the scale grows (default 2000).
      factor: growth and back-off factor (default 2).
      min_scale: the scale never goes below this (default 1).

    Raises (at construction):
      ValueError: a scale below ``min_scale``, a factor <= 1, or an interval < 1.
    """

    scale: float = 2.0 ** 15
    counter: int = 0
    growth_interval: int = 2000
    factor: float = 2.0
    min_scale: float = 1.0

    def __post_init__(self):
        if not (self.min_scale > 0 and self.scale >= self.min_scale):
            raise ValueError(f"loss scale {self.scale} must be >= min_scale {self.min_scale} > 0")
        if not self.factor > 1 or self.growth_interval < 1:
            raise ValueError(f"factor must be > 1 (got {self.factor}) and growth_interval >= 1 "
                             f"(got {self.growth_interval})")

    def adjust(self, grads_finite: bool) -> "DynamicLossScale":
        """The scale for the next step, given whether this step's scaled gradients were finite
        (``not metrics["skipped"]``)."""
        if not grads_finite:
            return dataclasses.replace(self, scale=max(self.min_scale, self.scale / self.factor), counter=0)
        if self.counter + 1 >= self.growth_interval:
            return dataclasses.replace(self, scale=self.scale * self.factor, counter=0)
        return dataclasses.replace(self, counter=self.counter + 1)
