"""The ``chunkjax`` system of the benchmark (experiments/bench.py): plan, check, run.

1. Trace the stages for the batch shape on this backend (GPU: the GPU compiler's transient
   bytes) and plan a :class:`chunkjax.schedule.Schedule` for the device budget with the host
   AdamW kernel (updates of offloaded chunks run in place on the host, overlapping the backward).
2. Compile every program of the step and check the compiled peak (largest program's arguments +
   outputs + temporaries, plus the resident master params and optimizer state) against the
   budget less a headroom for the runtime's workspaces; while over, re-plan for a smaller
   effective budget (the tide underestimates what XLA keeps alive; docs/design.md).
3. Initialise chunk by chunk (no full params pytree anywhere), then measure with the same
   protocol as the baselines (:func:`experiments.bench.measure_system`).

The record adds the schedule's predictions (``*_accounted``) next to the measured figures.
"""
from __future__ import annotations

import dataclasses
import os
import time

#: fraction of the budget the compiled step may use; the rest is for cuDNN/cuBLAS workspaces
HEADROOM = 0.90


class ChunkjaxSystem:
    """The BaselineSystem interface (experiments/baselines.py) over a chunked step."""

    name = "chunkjax"

    def __init__(self, cfg, budget_bytes: int, batch: int, seq: int, lr: float = 1e-4,
                 segments="auto", host_update: bool = True, prefetch: int = 1, zero_stage: int = 0,
                 init: str = "leafwise"):
        import jax
        import jax.numpy as jnp

        import chunkjax as cj
        from chunkjax.host_update import AdamW
        from chunkjax.memory import DEVICE, sharding
        from chunkjax.optim import state_bytes_per_chunk
        from models import gpt

        if init not in ("leafwise", "init_params"):
            raise ValueError(f"init={init!r}: use 'leafwise' or 'init_params'")
        self.cfg, self.budget, self.notes, self.init_rule = cfg, int(budget_bytes), [], init
        self.last_update_s, self.last_timings = None, {}
        self.dev_sh = sharding(DEVICE)
        # ZeRO over every local device (chunkjax/zero_schedule.py): the budget is each rank's
        self.zero_stage = int(zero_stage or 0)
        self.mesh, self.n_ranks = None, 1
        if self.zero_stage:
            from jax.sharding import NamedSharding
            from jax.sharding import PartitionSpec as P

            from chunkjax.zero import AXIS, data_mesh
            self.mesh = data_mesh()
            self.n_ranks = int(self.mesh.devices.size)
            if batch % self.n_ranks:
                raise ValueError(f"batch {batch} does not split over {self.n_ranks} devices: use a multiple")
            self.dev_sh = NamedSharding(self.mesh, P(AXIS))
        self.spec = AdamW(lr, weight_decay=1e-4)
        t0 = time.perf_counter()
        stages = gpt.gpt_stages(cfg)
        ap = gpt.abstract_params(cfg)
        ab = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
        order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), ap, ab)
        self.layout = cj.build_layout(ap, None, order, min_chunks=8)
        if self.zero_stage:  # chunks that split over the ranks; each rank traces its rows
            from chunkjax.zero import build_zero_layout
            self.layout = build_zero_layout(ap, self.n_ranks, self.layout.chunk_size, order)
            ab = jax.ShapeDtypeStruct((batch // self.n_ranks, seq + 1), jnp.int32)
        self.traces = cj.trace_stages(stages, self.layout, ab, jnp.bfloat16)
        self.trace_s = time.perf_counter() - t0
        cb = cj.chunk_bytes(self.layout, jnp.bfloat16,
                            state_bytes_per_chunk(self.spec.optax(), self.layout.chunk_size))
        self.cb = cb
        self.cb_rank = cb
        if self.zero_stage:
            from chunkjax.zero_schedule import rank_chunk_bytes
            self.cb_rank = rank_chunk_bytes(cb, self.n_ranks, self.zero_stage)
        flops = cfg.flops_per_token(seq) * batch * seq // self.n_ranks  # one rank's
        from chunkjax.cost import Rates
        from chunkjax.plan import plan_schedule
        self.rates, self.matmul_tflops = Rates(), None
        if jax.default_backend() == "gpu":  # calibrate the cost model on this machine
            from chunkjax.host_update import measure_host_update_rate
            from experiments.gpu_measure import matmul_tflops
            self.matmul_tflops = matmul_tflops()
            self.rates = Rates.calibrated(self.matmul_tflops * 1e12, measure_host_update_rate(2**26))
        # host memory for offloaded model data: 80 % of this machine's RAM (the rest: the
        # process, XLA's host buffers, the page cache)
        self.host_budget = int(0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        kw = dict(flops_per_step=flops, host_update=host_update, prefetch=prefetch, segments=segments,
                  rates=self.rates, host_budget_bytes=self.host_budget // self.n_ranks)
        if self.zero_stage:
            from chunkjax.zero_schedule import plan_zero_schedule
            self._plan = lambda b: plan_zero_schedule(self.layout, self.traces, cb, int(b), self.n_ranks,
                                                      self.zero_stage, **kw)
        else:
            self._plan = lambda b: plan_schedule(self.layout, self.traces, cb, int(b), **kw)
        self.stages = stages
        self.use_budget(self.budget)

    def use_budget(self, budget_bytes: int) -> None:
        """Plan for another device budget (the traces and calibrated rates are kept);
        :meth:`compiled_memory` re-checks the compiled peak against it."""
        self.budget = self.effective_budget = int(budget_bytes)
        self.use_schedule(self._plan(self.budget))
        self.replan = True

    def use_schedule(self, schedule) -> None:
        """Run a given :class:`chunkjax.schedule.Schedule` (e.g. a static baseline of
        experiments/plan.py) with this system's layout and host optimizer."""
        self.schedule = schedule
        self.step_fn = self._make_step(schedule)
        self.plan_history = []
        self.replan = False  # a given schedule is checked, never replaced

    def _make_step(self, schedule):
        import chunkjax as cj
        if self.zero_stage:
            from chunkjax.zero_schedule import make_zero_scheduled_step
            return make_zero_scheduled_step(self.stages, self.layout, schedule, self.mesh,
                                            zero_stage=self.zero_stage, host_optimizer=self.spec)
        return cj.make_chunked_step(self.stages, self.layout, schedule, host_optimizer=self.spec)

    # -- the BaselineSystem interface --------------------------------------------------------
    def compiled_memory(self, batch) -> dict:
        """Compile every program; re-plan until the compiled peak fits HEADROOM x budget."""
        import chunkjax as cj

        for attempt in range(4):
            progs = self.step_fn.compiled_memory_programs(batch)
            n_res = sum(u == "device" for u in self.schedule.update_locations)
            cb = self.cb_rank  # one rank's bytes (the whole chunk without ZeRO)
            resident_state = n_res * cb.state
            # the update phase holds every resident chunk (params and state) and all their
            # gradients, plus one chunk's float32 temporaries: it must fit the headroom too
            # (GPT3_12B on the whole card ran out of memory there when only the fwd/bwd was checked)
            update_phase = n_res * (cb.params + cb.state + cb.grad) + 2 * 4 * self.layout.chunk_size
            peak = max(max(p["peak_device_bytes"] for p in progs) + resident_state, update_phase)
            self.plan_history.append({"effective_budget_bytes": self.effective_budget,
                                      "compiled_peak_bytes": peak,
                                      "predicted_peak_bytes": self.schedule.predicted.peak_device_bytes,
                                      "counts": self.schedule.counts()})
            if peak <= HEADROOM * self.budget or not self.replan:
                break
            # shrink the planning budget by the overshoot and try again
            self.effective_budget = int(self.effective_budget * HEADROOM * self.budget / peak) - self.cb.params
            try:
                self.schedule = self._plan(self.effective_budget)
            except cj.PlanError as e:
                self.notes.append(f"re-plan failed: {e}")
                break
            self.step_fn = self._make_step(self.schedule)
        largest = max(progs, key=lambda p: p["peak_device_bytes"])
        out = {"peak_bytes": int(peak), "argument_bytes": largest["argument"], "output_bytes": largest["output"],
               "temp_bytes": largest["temp"], "alias_bytes": largest["alias"],
               "resident_state_bytes": int(resident_state), "programs": progs}
        if peak > HEADROOM * self.budget and self.replan:
            # no plan fits under the headroom: running the last one would run out of memory
            # (GPT3_12B at 100 GiB did, after a failed re-plan)
            out["fits"] = False
            out["why"] = (f"compiled peak {peak} B exceeds {HEADROOM:.0%} of the budget {self.budget} B after "
                          f"{len(self.plan_history)} plan(s)" + (f"; {self.notes[-1]}" if self.notes else ""))
        self.last_compiled_memory = out
        return out

    def init(self, key):
        """fp32 master params from ``key``, chunked into the step's state.

        ``init="leafwise"`` (default): :func:`models.gpt.leaf_initializer`, one leaf at a time
        (host memory stays bounded; values differ from the baselines'). ``init="init_params"``:
        the baselines' values (:func:`experiments.baselines.init_master_piecewise`, held whole in
        pinned host memory), so losses compare step by step with ``plain_jax`` (bench
        ``--set init=init_params``).
        """
        import jax
        import numpy as np

        from chunkjax.memory import PINNED_HOST, sharding
        from models import gpt

        pinned = sharding(PINNED_HOST)
        if self.init_rule == "init_params":
            from experiments.baselines import init_master_piecewise

            params = init_master_piecewise(self.cfg, key, lambda t: jax.device_put(t, pinned), jax.devices()[0])

            def leaf_np(i):
                node = params
                for part in self.layout.slots[i].path.split("/"):
                    node = node[part]
                return np.asarray(node)
        else:
            leaf = gpt.leaf_initializer(self.cfg, key, self.layout)

            def leaf_np(i):  # generated on the device, read through pinned host memory (fast path)
                return np.asarray(jax.device_put(leaf(i), pinned))

        return self.step_fn.init(leaf_np)

    def step(self, state, batch):
        state, m = self.step_fn(state, batch)
        self.step_fn.wait()
        self.last_update_s = getattr(self.step_fn, "last_host_update_s", None)  # host thread's kernel seconds
        return state, m["loss"]

    def host_bytes(self, state) -> int:
        import numpy as np

        n = 0
        for c, u in enumerate(self.schedule.update_locations):
            if u == "device":
                continue
            n += self.cb.params + self.cb.grad  # pinned compute params + the gradient chunk
            m = state.master[c]
            n += m.nbytes if isinstance(m, np.ndarray) else self.cb.master
            st = state.opt_state[c]
            n += getattr(st, "nbytes", self.cb.opt) if not callable(getattr(st, "nbytes", None)) else st.nbytes()
        return int(n)


def run_chunkjax(args) -> dict:
    """Measure chunkjax for ``args`` (model, batch, seq, steps, seed, budget_bytes, compile_only);
    returns the record of :func:`experiments.bench.measure_system` plus the schedule's
    predictions."""
    from experiments.bench import measure_system
    from models import gpt

    cfg = gpt.get_config(args.model)
    segments = getattr(args, "segments", "auto")
    sys_ = ChunkjaxSystem(cfg, args.budget_bytes, args.batch, args.seq, segments=segments,
                          zero_stage=getattr(args, "zero_stage", 0), init=getattr(args, "init", "leafwise"))
    try:
        rec = measure_system(sys_, args)
    except Exception as e:  # keep the plan next to the failure (e.g. out of memory at run time)
        import traceback
        rec = {"feasible": False, "error": f"{type(e).__name__}: {e}"[:2000],
               "traceback_tail": traceback.format_exc().strip().splitlines()[-8:],
               "notes": list(sys_.notes), "compiled_memory": getattr(sys_, "last_compiled_memory", None)}
        if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
            from experiments.gpu_measure import live_arrays_summary
            try:  # what held the device memory when the allocation failed
                rec["live_arrays_at_failure"] = live_arrays_summary()
            except Exception as e2:
                rec["live_arrays_at_failure"] = {"error": f"{type(e2).__name__}: {e2}"}
    p = sys_.schedule.predicted
    rec.update({
        "peak_device_bytes_accounted": p.peak_device_bytes,
        "h2d_bytes_per_step_accounted": p.h2d_bytes_per_step,
        "d2h_bytes_per_step_accounted": p.d2h_bytes_per_step,
        "step_s_predicted": p.time.step_s,
        "predicted_time": p.time.to_dict(),
        "schedule_counts": sys_.schedule.counts(),
        "segments": list(sys_.schedule.segments),
        "n_chunks": sys_.layout.n_chunks, "chunk_size": sys_.layout.chunk_size,
        "n_fetches": p.n_fetches,
        "effective_budget_bytes": sys_.effective_budget, "host_budget_bytes": sys_.host_budget, "plan_history": sys_.plan_history,
        "trace_s": sys_.trace_s, "rates": dataclasses.asdict(sys_.rates),
        "stage_temp_bytes": {t.name: t.temp_bytes for t in sys_.traces if t.name in ("embed", "h_0", "head")},
        "schedule": sys_.schedule.to_dict(),
        "n_devices": sys_.n_ranks, "zero_stage": sys_.zero_stage, "init": sys_.init_rule,
    })
    if sys_.zero_stage:  # bytes each rank sends through collectives per step (ring algorithms)
        import jax
        import jax.numpy as jnp
        ab = jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32)
        rec["comm_bytes_per_step_per_rank_accounted"] = sys_.step_fn.comm_bytes_per_step(ab)
    if rec.get("step_s_median") and p.time.step_s:
        rec["step_time_ratio_measured_over_predicted"] = rec["step_s_median"] / p.time.step_s
    return rec
