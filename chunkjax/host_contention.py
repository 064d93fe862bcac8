"""The host optimizer kernel's rate beside a training step's other work (issue 23 item 1: the cost model's
host term checked against the measured step).

Inside a step the host thread's kernel (:func:`chunkjax.host_update.host_update_`) shares the host's memory with the
step's PCIe transfers (the fetches read pinned host memory, the gradient offloads write it: DMA through the same
memory controllers) while the device computes. Measured on three lent H200 machines
(``experiments/results/host_rate_probe_s18.json``, ``experiments/gpu_checks/host_rate_probe.py``): the kernel alone
0.170 / 0.240 / 0.200-0.216 ns/param; walked over the step's chunk layout (32 chunks of 39.3M params, 20 GB) 0.170 /
0.240, so neither the working set beyond the last-level cache nor the layout slows it; beside the device's matmuls
alone 1.09x / 1.01x, beside both PCIe directions alone (71-80 GB/s) 1.50x / 1.06x; beside both together 0.274 /
0.359 / 0.281 ns/param (median; 1.6x / 1.5x / 1.4x); fewer numba threads (15, 14) no faster. The recorded GPT3_6B
b16 steps ran their host kernel at 0.271-0.331 ns/param against start-up calibrations (alone) of 0.214-0.232, and
0.296 on a day whose step still ran at 0.298. With the guided kernel (:mod:`chunkjax.kernel_threads`, session 25)
each timing alone erred by up to 14-24 % against the in-step rate, their combination (:func:`planned_step_rate`) by up
to 9 %.

:func:`planned_step_rate` is the rate the GPU calibration plans a step's host thread at (the
``host_update_loaded_s_per_param`` of :class:`chunkjax.cost.Rates`); :func:`measure_loaded_host_update_rate`
times the kernel under that load (recorded beside it); :func:`step_host_s_per_param` is the rate the cost model
times a step's host thread at.
"""
from __future__ import annotations

import math
import statistics
import threading
import time

#: The host kernel's seconds per parameter inside a training step over its seconds alone (the
#: start-up calibration's fastest call, :func:`chunkjax.host_update.measure_host_update_rate`), for
#: the guided kernel (:mod:`chunkjax.kernel_threads`): 1.18-1.30 over the six unclipped GPT3_6B b16
#: runs of session 25 on the lent H200 (median 1.22; ``docs/benchmarks.md``, "Twenty-fifth
#: session"). :func:`planned_step_rate` uses it.
IN_STEP_OVER_ALONE = 1.22


def planned_step_rate(alone_s_per_param: float, loaded_s_per_param: float = 0.0) -> float:
    """The host thread's seconds per parameter the planner times a training step at, from the
    kernel's start-up calibrations on this machine: the geometric mean of
    ``alone_s_per_param * IN_STEP_OVER_ALONE`` and ``loaded_s_per_param`` (the fastest call beside
    the device's compute and both PCIe directions, :func:`measure_loaded_host_update_rate`), or
    ``alone_s_per_param * IN_STEP_OVER_ALONE`` where the loaded one is not given (<= 0). The value for
    ``Rates.host_update_loaded_s_per_param``.

    Why both: each is one short timing on a busy machine. Over the 12 GPT3_6B runs of sessions 25-26
    with the guided kernel, against the rate the step's host thread then ran at, the alone one times
    :data:`IN_STEP_OVER_ALONE` erred by -12..+24 % (rms 8.6 %), the loaded one by -12..+14 % (7.1 %),
    their geometric mean by -8..+9 % (5.2 %); a reading 14-24 % slow planned 8-9 streamed chunks and a
    step 8-15 % slower (``docs/design.md``, "The host rate the plan assumes").

    Args:
      alone_s_per_param: the kernel alone, seconds per parameter (> 0).
      loaded_s_per_param: the kernel beside the step's kind of load (seconds per parameter; <= 0:
        not measured).

    Raises:
      ValueError: a rate that is not a positive finite number (the alone one; the loaded one
        when given).
    """
    a, lo = float(alone_s_per_param), float(loaded_s_per_param)
    bad = [x for x in ((a,) if lo <= 0 else (a, lo)) if not (0 < x < float("inf"))]
    if bad or lo != lo:
        raise ValueError(f"planned_step_rate({alone_s_per_param!r}, {loaded_s_per_param!r}): give the kernel's "
                         "measured seconds per parameter, positive finite numbers (the loaded one <= 0 when "
                         "not measured)")
    return math.sqrt(a * IN_STEP_OVER_ALONE * lo) if lo > 0 else a * IN_STEP_OVER_ALONE


def step_host_s_per_param(rates) -> float:
    """Seconds per parameter of the host kernel inside a training step (the step's host thread, the
    cross-step tail): ``rates.host_update_loaded_s_per_param`` where measured (> 0: the kernel beside
    the device's compute and both PCIe directions, :func:`measure_loaded_host_update_rate`), else
    ``rates.host_update_s_per_param`` (the kernel alone, or a rate already measured inside a step:
    :meth:`chunkjax.cost.Rates.from_record`).

    Args:
      rates: a :class:`chunkjax.cost.Rates` (or an object with those two attributes).
    """
    loaded = float(getattr(rates, "host_update_loaded_s_per_param", 0.0) or 0.0)
    return loaded if loaded > 0 else float(rates.host_update_s_per_param)


class _Load:
    """Threads keeping the device and both PCIe directions busy between :meth:`start` and :meth:`stop`:
    ``up`` moves a pinned host buffer to the device, ``down`` a device buffer to pinned host memory,
    each one transfer at a time; ``compute`` runs bf16 matmuls on the device, waiting every 8."""

    def __init__(self, load_bytes: int, matmul: int, device=None):
        import jax
        import jax.numpy as jnp
        import numpy as np

        from chunkjax.memory import DEVICE, PINNED_HOST, sharding
        n = max(1, int(load_bytes) // 2)
        self.to_dev, self.to_host = sharding(DEVICE, device), sharding(PINNED_HOST, device)
        self.host = jax.device_put(np.zeros(n, jnp.bfloat16), self.to_host)
        self.dev = jax.device_put(np.zeros(n, jnp.bfloat16), self.to_dev)
        self.a = jax.device_put(np.full((matmul, matmul), 1.0, jnp.bfloat16), self.to_dev)
        self.mm = jax.jit(lambda a: (a @ a) * (1.0 / matmul))  # ones stay ones: no overflow to inf
        self.mm(self.a).block_until_ready()  # compiled before the timing
        jax.block_until_ready((jax.device_put(self.host, self.to_dev), jax.device_put(self.dev, self.to_host)))
        self.stop_ev = threading.Event()
        self.moved = {"up": 0, "down": 0}
        self.threads: list[threading.Thread] = []

    def _up(self):
        import jax
        while not self.stop_ev.is_set():
            jax.device_put(self.host, self.to_dev).block_until_ready()
            self.moved["up"] += self.host.nbytes

    def _down(self):
        import jax
        while not self.stop_ev.is_set():
            jax.device_put(self.dev, self.to_host).block_until_ready()
            self.moved["down"] += self.dev.nbytes

    def _compute(self):
        x = self.a
        while not self.stop_ev.is_set():
            for _ in range(8):
                x = self.mm(x)
            x.block_until_ready()

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._up, self._down, self._compute)]
        for t in self.threads:
            t.start()

    def stop(self) -> tuple[float, float]:
        """Stop the threads; ``(up, down)`` bytes per second moved while they ran."""
        self.stop_ev.set()
        for t in self.threads:
            t.join()
        dt = max(time.perf_counter() - self.t0, 1e-9)
        return self.moved["up"] / dt, self.moved["down"] / dt


def measure_loaded_host_update_rate(n: int = 2**26, repeats: int = 10, *, load_bytes: int = 2**28,
                                    matmul: int = 4096, settle_s: float = 0.2, stats: dict | None = None,
                                    device=None) -> float:
    """Seconds per parameter of the in-place AdamW kernel (bf16 gradient in, bf16 params out, all numba
    threads; as :func:`chunkjax.host_update.measure_host_update_rate`) while the device computes and both
    PCIe directions move data (what a training step does beside its host thread): the median of
    ``repeats`` timed calls after a warm-up call (the load's slowing is what is measured, so not the
    fastest; on the H200 the median of 5 calls read 0.309 ns/param on one buffer set against 0.281 over
    the step's layout, its fastest 0.268-0.295: hence 10). Calibrates
    ``chunkjax.cost.Rates.host_update_loaded_s_per_param`` (module docstring).

    Meaningful on a GPU; on the CPU backend the transfers between memory kinds compile to nothing and the
    load is Python threads (tests run it small). Allocates about 16 bytes per parameter on the host
    plus ``load_bytes`` of pinned host and of device memory and two ``matmul`` x ``matmul`` bf16 buffers.

    Args:
      n: parameters (>= 1). repeats: timed calls (>= 1). load_bytes: bytes of each direction's transfer
      (one buffer, moved again and again). matmul: the device matmul's size. settle_s: seconds the load
      runs before the first timed call. stats: if given, filled with ``loaded_min_s_per_param``,
      ``loaded_median_s_per_param``, ``loaded_n``, ``loaded_repeats``, ``loaded_h2d_bytes_per_s`` and
      ``loaded_d2h_bytes_per_s`` (the load's rates while the kernel ran). device: the device (default the
      first).

    Raises:
      ValueError: ``n`` or ``repeats`` below 1.
    """
    if n < 1 or repeats < 1:
        raise ValueError(f"measure_loaded_host_update_rate(n={n}, repeats={repeats}): use n >= 1 and repeats >= 1")
    from chunkjax.host_update import host_update_, rate_problem
    spec, state, grad, master, out = rate_problem(n)
    load = _Load(load_bytes, matmul, device)
    load.start()
    try:
        time.sleep(settle_s)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            host_update_(spec, state, grad, master, out)
            times.append(time.perf_counter() - t0)
    finally:
        up, down = load.stop()
    if stats is not None:
        stats.update(loaded_min_s_per_param=float(min(times)) / n,
                     loaded_median_s_per_param=float(statistics.median(times)) / n, loaded_n=int(n),
                     loaded_repeats=int(repeats), loaded_h2d_bytes_per_s=float(up), loaded_d2h_bytes_per_s=float(down))
    return float(statistics.median(times)) / n


__all__ = ["IN_STEP_OVER_ALONE", "measure_loaded_host_update_rate", "planned_step_rate", "step_host_s_per_param"]
