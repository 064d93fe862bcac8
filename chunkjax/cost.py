"""A small step-time model, calibrated by measured rates (shared/guides/gpu_facts.md).

Predicted step time = forward/backward time + update time, where the forward/backward is bound by
whichever is slower of compute (training FLOPs plus the per-stage recompute, at the matmul rate)
and the chunk traffic of that phase (PCIe, one direction at a time inside one program); the update
phase moves streamed chunks' state both ways and updates every parameter where its chunk lives.
The defaults are the H200 figures measured on the lent machine; pass measured values when known.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Rates:
    """Measured rates (units in the names).

    Attributes:
      matmul_flops_per_s: achieved training FLOP rate (plain JAX reached 336-367 TFLOP/s on the
        H200 with remat; the 8192^3 jnp.dot probe 587).
      h2d_bytes_per_s: host -> device over PCIe, one direction (53-55 GB/s).
      d2h_bytes_per_s: device -> host, one direction.
      one_program_duplex_bytes_per_s: both directions inside one jitted program (57 GB/s).
      device_update_s_per_param: AdamW with state resident on the device (0.0074 ns).
      host_update_s_per_param: in-place host AdamW on 16 cores (0.27 ns).
    """

    matmul_flops_per_s: float = 350e12
    h2d_bytes_per_s: float = 54e9
    d2h_bytes_per_s: float = 54e9
    one_program_duplex_bytes_per_s: float = 57e9
    device_update_s_per_param: float = 0.0074e-9
    host_update_s_per_param: float = 0.27e-9


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Predicted seconds per step and where they go."""

    compute_s: float
    fwd_bwd_transfer_s: float
    update_transfer_s: float
    update_compute_s: float

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.fwd_bwd_transfer_s) + self.update_transfer_s + self.update_compute_s

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"step_s": self.step_s}


def predict_step_time(flops_per_step: float, recompute_fraction: float, fwd_bwd_h2d: int, fwd_bwd_d2h: int,
                      update_h2d: int, update_d2h: int, device_params: int, host_params: int,
                      rates: Rates = Rates()) -> StepTime:
    """Predict one step's time.

    Args:
      flops_per_step: training FLOPs (6N + 12LSh per token, times tokens).
      recompute_fraction: extra forward FLOPs from per-stage recompute, as a fraction of
        ``flops_per_step`` (about 1/3 with full recompute of every block).
      fwd_bwd_h2d / fwd_bwd_d2h: bytes moved during forward/backward.
      update_h2d / update_d2h: bytes moved by the update phase.
      device_params / host_params: parameters updated on the device / on the host.
    """
    compute = flops_per_step * (1 + recompute_fraction) / rates.matmul_flops_per_s
    fb = (fwd_bwd_h2d + fwd_bwd_d2h) / rates.one_program_duplex_bytes_per_s
    up = update_h2d / rates.h2d_bytes_per_s + update_d2h / rates.d2h_bytes_per_s
    upd = device_params * rates.device_update_s_per_param + host_params * rates.host_update_s_per_param
    return StepTime(compute, fb, up, upd)
