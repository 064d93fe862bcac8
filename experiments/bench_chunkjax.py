"""The ``chunkjax`` system of the benchmark (experiments/bench.py): the one fit path, then measure.

1. :func:`chunkjax.fit.prepare`: layout, stage traces for the batch shape on this backend (GPU:
   the GPU compiler's transient bytes), the cost model calibrated on this machine
   (:func:`experiments.gpu_measure.calibrated_rates`), host AdamW updates.
2. :func:`chunkjax.fit.fit_problem` (in :meth:`ChunkjaxSystem.compiled_memory`): the tide plan,
   the host-memory check, every program of the step compiled, re-planned while the compiled peak
   exceeds :data:`chunkjax.fit.HEADROOM` of the budget. The main job (experiments/train.py) runs
   the same path, so the two plan alike.
3. Initialise chunk by chunk (no full params pytree anywhere), then measure with the same
   protocol as the baselines (:func:`experiments.measure.measure_system`).

The record adds the schedule's predictions (``*_accounted``) next to the measured figures.
"""
from __future__ import annotations

import dataclasses
import sys
import time


class ChunkjaxSystem:
    """The BaselineSystem interface (experiments/baselines.py) over the fit path's step.

    Attributes read by experiments/sweep.py: ``layout``, ``traces``, ``cb`` (whole-chunk bytes),
    ``rates``, ``matmul_tflops``, ``schedule``, ``step_fn``, ``budget``, ``plan_history``,
    ``dev_sh`` (the batch's sharding); :meth:`use_budget` / :meth:`use_schedule` switch plans.
    """

    name = "chunkjax"

    def __init__(self, cfg, budget_bytes: int, batch: int, seq: int, lr: float = 1e-4,
                 segments="auto", host_update: bool = True, prefetch: int = 1, zero_stage: int = 0,
                 init: str = "leafwise", max_grad_norm: float | None = None, micro_batches: int = 1,
                 storage=None, host_budget="auto", cross_step: bool = True, remat: str = "full",
                 unroll_micro_batches: bool | str = "auto", clip_expect: str = "auto", chunk_size: int | None = None,
                 compiled_margin: int = 0, rates_from: str | None = None, rollback: str = "backup",
                 turn_cut: bool = True):
        import jax
        import jax.numpy as jnp

        import chunkjax as cj
        from chunkjax import fit
        from chunkjax.host_update import AdamW
        from chunkjax.host_ledger import HostLedger
        from experiments.gpu_measure import calibrated_rates
        from models import gpt

        # the process's RSS by kind at each phase, on stderr as it is read: a worker the OOM killer ends
        # has shown the plan's host parts and how far it got (issue 24)
        self.ledger = HostLedger(echo=lambda line: print(line, file=sys.stderr, flush=True))
        self.ledger.mark("start")

        if init not in ("leafwise", "init_params"):
            raise ValueError(f"init={init!r}: use 'leafwise' or 'init_params'")
        self.cfg, self.budget, self.notes, self.init_rule = cfg, int(budget_bytes), [], init
        self.compiled_margin = int(compiled_margin)  # bytes the first plan leaves for the compiler (fit.fit_problem)
        # cross-step overlap (chunkjax.cross_step): planned for (forward cuts, the host tail timed against the
        # next forward's reads) and run; the previous step's host work is joined inside the next step
        self.cross_step, self._last_work = bool(cross_step), None
        self.last_update_s, self.last_timings = None, {}
        self.speculation = {"steps": 0, "speculated_chunks": 0, "inverted_chunks": 0, "redone_chunks": 0,
                            "pool_bytes": 0, "kept_grad_bytes_peak": 0}
        # ZeRO over every local device (make_chunked_step(..., mesh=, zero_stage=)): the budget is each rank's
        self.zero_stage = int(zero_stage or 0)
        self.mesh = cj.data_mesh() if self.zero_stage else None
        self.n_ranks = 1 if self.mesh is None else int(self.mesh.devices.size)
        if batch % self.n_ranks:
            raise ValueError(f"batch {batch} does not split over {self.n_ranks} devices: use a multiple")
        self.spec = AdamW(lr, weight_decay=1e-4, max_grad_norm=max_grad_norm)
        self.host_rate_calibration: dict = {}  # the host kernel timing's min and median (GPU only)
        self.rates, self.matmul_tflops = calibrated_rates(self.host_rate_calibration)
        self.rates_from = rates_from
        if rates_from:  # plan with the host kernel's rate inside a recorded run's step (issue 23 item 1)
            self.rates = in_step_host_rate(self.rates, rates_from)
        t0 = time.perf_counter()
        self.problem = fit.prepare(gpt.gpt_stages(cfg), gpt.abstract_params(cfg),
                                   jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32),
                                   tx=None if host_update else self.spec.optax(),
                                   host_optimizer=self.spec if host_update else None, compute_dtype=jnp.bfloat16,
                                   prefetch=prefetch, segments=segments, mesh=self.mesh, zero_stage=self.zero_stage,
                                   micro_batches=micro_batches,
                                   flops_per_step=cfg.flops_per_token(seq) * batch * seq, rates=self.rates,
                                   device_budget=self.budget, storage=storage or None, host_budget=host_budget,
                                   cross_step=self.cross_step,  # planned and run so
                                   unroll_micro_batches=unroll_micro_batches,
                                   clip_expect=clip_expect,  # "auto": "fires" with max_grad_norm (chunkjax.clip_plan)
                                   chunk_size=chunk_size)  # None: chunkjax.layout.search_chunk_size
        if rollback != "backup":  # speculative host updates undone by inversion (chunkjax.speculate; --set rollback=invert)
            self.problem = dataclasses.replace(self.problem, rollback=rollback)
        if not turn_cut:  # the program cuts before the turn cuts (chunkjax.program_cut.turn_cut; --set turn_cut=0)
            self.problem = dataclasses.replace(self.problem, turn_cut=False)
        if remat != "full":  # blocks keep their MLP activation (chunkjax.plan_remat; bench --set remat=auto|save|offload)
            self.problem = dataclasses.replace(self.problem, remat=remat, remat_names=gpt.REMAT_NAMES)
        self.disk, self.disk_steps = None, []  # the disk tier: the storage chunks' DiskState, each step's result
        self.trace_s = time.perf_counter() - t0
        p = self.problem
        self.stages, self.layout, self.traces, self.cb, self.cb_rank = p.stages, p.layout, p.traces, p.cb, p.cb_rank
        self.dev_sh = p.batch_sharding
        # host memory for offloaded model data (this process, all ranks): what MemAvailable leaves
        self.host_budget = p.host_budget_bytes
        self.use_budget(self.budget)
        self.ledger.mark("plan")
        self.steps_done = 0

    def use_budget(self, budget_bytes: int) -> None:
        """Plan for another device budget (the traces and calibrated rates are kept);
        :meth:`compiled_memory` re-checks the compiled peak against it and re-plans."""
        from chunkjax import fit
        self.budget = self.effective_budget = int(budget_bytes)
        self.use_schedule(fit.plan(self.problem, self.budget))
        self.replan = True

    def use_schedule(self, schedule) -> None:
        """Run a given :class:`chunkjax.schedule.Schedule` (e.g. a static baseline of
        experiments/plan.py) with this system's layout and host optimizer."""
        from chunkjax import fit
        self.schedule = schedule
        self.step_fn = fit.build_step(self.problem, schedule)
        self.plan_history = []
        self.replan = False  # a given schedule is checked, never replaced

    # -- the BaselineSystem interface --------------------------------------------------------
    def compiled_memory(self, batch) -> dict:
        """The fit path's compiled check (:func:`chunkjax.fit.fit_problem`): every program
        compiled, re-planned (after :meth:`use_budget`) until the compiled peak fits
        ``HEADROOM`` x budget; ``fits: False`` and ``why`` when it never does."""
        from chunkjax import fit
        del batch  # the fit path compiles for the problem's batch shape
        f = fit.fit_problem(self.problem, self.budget, schedule=None if self.replan else self.schedule,
                            check_compiled=True, strict=False, compiled_margin=self.compiled_margin)
        rep = f.report
        self.schedule, self.step_fn = rep.schedule, f.step
        self.effective_budget, self.plan_history = rep.effective_budget_bytes, list(rep.plans)
        self.notes += list(rep.notes)
        mem = rep.compiled
        out = {"peak_bytes": mem["peak_bytes"], "argument_bytes": mem["argument_bytes"],
               "output_bytes": mem["output_bytes"], "temp_bytes": mem["temp_bytes"], "alias_bytes": mem["alias_bytes"],
               "resident_state_bytes": mem["resident_state_bytes"], "update_phase_bytes": mem["update_phase_bytes"],
               "programs": mem["programs"]}
        if not rep.fits:  # no plan fits under the headroom: running the last one would run out of memory
            out["fits"], out["why"] = False, rep.why
        self.last_compiled_memory = out
        self.ledger.mark("compile")
        self.ledger.account(self.host_parts(rep.host), held_at="plan")  # printed before anything is initialised
        return out

    def plan_progress(self) -> dict:
        """The plan's predictions as plain numbers, printed by the worker right after the compiled
        check (:func:`experiments.measure.run`), so that a worker stopped before its record keeps
        them: step seconds, device and host bytes accounted, chunk counts, micro-batches, and with
        the disk tier its accounted bytes per step and near-storage update seconds."""
        p = self.schedule.predicted
        out = {"step_s_predicted": reported_time(self).step_s, "peak_device_bytes_accounted": int(p.peak_device_bytes),
               "host_bytes_accounted": int(p.host_bytes), "host_budget_bytes": self.host_budget,
               "effective_budget_bytes": self.effective_budget, "schedule_counts": self.schedule.counts(),
               "micro_batches": self.problem.micro_batches, "accumulation": self.schedule.accumulation,
               "compiled_peak_bytes": (getattr(self, "last_compiled_memory", None) or {}).get("peak_bytes")}
        if self.problem.storage is not None:
            out["storage"] = {"storage_chunks": p.storage_chunks, "disk_bytes_per_step_accounted": p.disk_bytes_per_step,
                              "storage_update_s_predicted": p.time.storage_update_s}
        return out

    def host_parts(self, host: dict | None = None) -> dict:
        """The plan's host bytes by part (:func:`chunkjax.host_ledger.plan_parts`; ``host``: the
        fit's host need, default the schedule's)."""
        from chunkjax.fit_host import host_need
        from chunkjax.host_ledger import plan_parts
        return plan_parts(self.problem, self.schedule, host or host_need(self.problem, self.schedule))

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

        from chunkjax.host_ledger import release_free_heap
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

        n_calls, calls = 2 * len(self.layout.slots), [0]  # at most: step.init draws a leaf again for device params
        locs, mf = self.schedule.update_locations, set(self.schedule.master_fetch)

        def leaf_marked(i):  # the ledger at each sixteenth of the init (where a GPU run's RSS grew, and at which chunks)
            calls[0] += 1
            if calls[0] % max(1, n_calls // 16) == 0:
                c = self.layout.slots[i].pieces[0].chunk
                self.ledger.mark(f"init leaf {calls[0]}/{n_calls} (chunk {c}: {locs[c]}"
                                 f"{', master-fetch' if c in mf else ''})")
            return leaf_np(i)

        state = self.step_fn.init(leaf_marked)
        self.ledger.mark("init")
        release_free_heap()  # what the init's temporaries left in the C heap
        self.ledger.mark("init, heap trimmed")
        return state

    def step(self, state, batch):
        state, m = self.step_fn(state, batch)
        # the host thread's kernel seconds (None: no host chunks) and the storage chunks' new params; the
        # disk tier's last writes and commit run on into the next step (chunkjax.storage.updater.StorageRun).
        # With cross-step overlap the work is the previous step's, joined inside this step: its seconds
        work = state.pending
        if self.step_fn.cross_step and "storage" not in self.schedule.update_locations:
            work, self._last_work = self._last_work, work
            self.last_update_s = None if work is None else work.seconds
        else:
            self.last_update_s = work.join() if work is not None else None
        self.steps_done += 1
        if self.steps_done <= 3:  # the first steps: where the RSS grew (issue 24); the rest is VmHWM
            self.ledger.mark(f"step {self.steps_done}")
        if "storage" in self.schedule.update_locations:  # the disk tier: each committed update's bytes and seconds
            self.disk = state.master[self.schedule.update_locations.index("storage")]
        self._account(work)
        self.last_grad_norm = m.get("grad_norm")  # the step's global gradient norm (bench ``grad_norms``)
        return state, m["loss"]

    def finish(self, state) -> None:
        """The final wait (before the worker returns): join the last step's host work (with
        cross-step overlap nothing joined it yet: its thread would still run at exit) and count
        its speculation."""
        self.step_fn.wait(state)
        work, self._last_work = self._last_work, None
        self._account(work)  # cross-step: the last step's work, joined only now (else step() counted it: None)

    def _account(self, work) -> None:
        sp = getattr(work, "speculation", None)  # speculative host updates (chunkjax.speculate), of a joined step
        if sp is not None:
            self.speculation["steps"] += 1
            self.speculation["speculated_chunks"] += sp.speculated
            self.speculation["redone_chunks"] += sp.redone
            self.speculation["inverted_chunks"] += getattr(sp, "inverted", 0)  # rollback by inversion: no backup
            self.speculation["pool_bytes"] = sp.pool.allocated_bytes
            self.speculation["kept_grad_bytes_peak"] = max(self.speculation["kept_grad_bytes_peak"],
                                                           getattr(sp, "kept_bytes_peak", 0))

    def host_bytes(self, state) -> int:
        import numpy as np

        n, mf = self.schedule.predicted.host_working_bytes, set(self.schedule.master_fetch)
        for c, u in enumerate(self.schedule.update_locations):
            if u == "device":
                continue
            if u == "storage":  # pinned compute params and the gradient; master params and state on disk
                n += self.cb.params + self.cb.grad
                continue
            if c in mf:  # master-fetch: the float32 master params are the pinned params (master: a view)
                n += self.cb.master
            else:  # pinned compute params, the master params
                n += self.cb.params
                m = state.master[c]
                n += m.nbytes if isinstance(m, np.ndarray) else self.cb.master
            n += self.cb.grad if u != "host" else 0  # streamed: the gradient; host: the working set
            st = state.opt_state[c]
            n += getattr(st, "nbytes", self.cb.opt) if not callable(getattr(st, "nbytes", None)) else st.nbytes()
        pool = getattr(state.pending, "backups", None)  # speculative host updates' backups (chunkjax.speculate)
        kept = self.speculation["kept_grad_bytes_peak"]  # gradients held for rollback by inversion
        return int(n + (pool.allocated_bytes if pool is not None else 0) + kept)


def in_step_host_rate(rates, record):
    """``rates`` (:class:`chunkjax.cost.Rates`) with the host AdamW kernel timed at the rate a recorded
    bench run's host thread measured inside its step (:meth:`chunkjax.cost.Rates.from_record`: its
    ``update_s`` over its host-updated params, seconds per param), in place of this call's start-up
    calibration (``host_update_loaded_s_per_param`` dropped: the in-step rate is the loaded one); the
    matmul and PCIe rates stay this call's. The bench's ``--set rates_from=RESULTS_JSON``.

    Raises:
      ValueError: the record has no ``chunkjax`` system with rates and a host update time.
      OSError: the file cannot be read.
    """
    import json
    import pathlib

    from chunkjax.cost import Rates
    rec = json.loads(pathlib.Path(record).read_text())
    s = (rec.get("systems") or {}).get("chunkjax") or {}
    counts = (s.get("extra") or {}).get("schedule_counts") or {}
    if not s.get("update_s") or not any(n for k, n in counts.items() if k.endswith("update_host")):
        raise ValueError(f"{record}: its chunkjax system records no host update time inside its step "
                         "(update_s with host-updated chunks): pass a bench record of a run with host chunks")
    r = Rates.from_record(rec, "chunkjax")
    return dataclasses.replace(rates, host_update_s_per_param=r.host_update_s_per_param,
                               host_update_loaded_s_per_param=0.0)


def _unroll_arg(value):
    """``--set unroll_micro_batches=`` as ``fit.prepare`` takes it: 1 / 0 (JSON ints or bools) as
    True / False, ``"auto"`` (the default) as is."""
    return value if isinstance(value, str) else bool(int(value))


def run_chunkjax(args) -> dict:
    """Measure chunkjax for ``args`` (model, batch, seq, steps, seed, budget_bytes, compile_only);
    returns the record of :func:`experiments.measure.measure_system` plus the schedule's
    predictions."""
    from experiments.measure import measure_system
    from models import gpt

    cfg = gpt.get_config(args.model)
    segments = getattr(args, "segments", "auto")
    sys_ = ChunkjaxSystem(cfg, args.budget_bytes, args.batch, args.seq, segments=segments,
                          zero_stage=getattr(args, "zero_stage", 0), init=getattr(args, "init", "leafwise"),
                          max_grad_norm=getattr(args, "max_grad_norm", None),
                          micro_batches=int(getattr(args, "micro_batches", 1)),
                          storage=_storage(args), host_budget=getattr(args, "host_budget", "auto"),
                          cross_step=bool(int(getattr(args, "cross_step", 1))),
                          remat=getattr(args, "remat", "full"),
                          unroll_micro_batches=_unroll_arg(getattr(args, "unroll_micro_batches", "auto")),
                          clip_expect=str(getattr(args, "clip_expect", "auto")),
                          chunk_size=int(getattr(args, "chunk_size", 0) or 0) or None,  # --set chunk_size=N
                          compiled_margin=int(float(getattr(args, "compiled_margin", 0) or 0)),  # --set compiled_margin=5.8e9
                          rates_from=getattr(args, "rates_from", None) or None,  # --set rates_from=RESULTS_JSON
                          rollback=str(getattr(args, "rollback", "backup")),  # --set rollback=invert
                          turn_cut=bool(int(getattr(args, "turn_cut", 1))))  # --set turn_cut=0
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
    t = reported_time(sys_)  # the plan's, with a speculating step's bound (chunkjax.clip_plan.speculation_bound)
    rec.update({
        "peak_device_bytes_accounted": p.peak_device_bytes,
        "h2d_bytes_per_step_accounted": p.h2d_bytes_per_step,
        "d2h_bytes_per_step_accounted": p.d2h_bytes_per_step,
        "step_s_predicted": t.step_s, "step_s_planned": p.time.step_s, "speculation_bound": _bound_record(sys_),
        "host_bytes_accounted": p.host_bytes,
        # the plan's own bytes per parameter (issue 24 item 1): host bytes over every parameter, and
        # over the host-resident chunks' (their master, state and the working set); model data per
        # parameter as the plan counts it (compute params + master + optimizer state)
        "host_bytes_per_param_accounted": p.host_bytes_per_param,
        "host_resident_bytes_per_param": p.host_resident_bytes_per_param,
        "model_bytes_per_param": (sys_.cb.params + sys_.cb.state) / sys_.layout.chunk_size,
        "predicted_time": t.to_dict(),
        "schedule_counts": sys_.schedule.counts(),
        "segments": list(sys_.schedule.segments),
        "n_chunks": sys_.layout.n_chunks, "chunk_size": sys_.layout.chunk_size,
        "n_fetches": p.n_fetches,
        "effective_budget_bytes": sys_.effective_budget, "host_budget_bytes": sys_.host_budget, "plan_history": sys_.plan_history,
        "trace_s": sys_.trace_s, "rates": dataclasses.asdict(sys_.rates),
        "host_rate_calibration": getattr(sys_, "host_rate_calibration", {}), "rates_from": sys_.rates_from,
        "stage_temp_bytes": {t.name: t.temp_bytes for t in sys_.traces if t.name in ("embed", "h_0", "head")},
        "schedule": sys_.schedule.to_dict(),
        "n_devices": sys_.n_ranks, "zero_stage": sys_.zero_stage, "init": sys_.init_rule,
        "max_grad_norm": sys_.spec.max_grad_norm, "micro_batches": sys_.problem.micro_batches,
        "cross_step": sys_.step_fn.cross_step, "unroll_micro_batches": sys_.schedule.unroll_micro_batches,
        "accumulation": sys_.schedule.accumulation, "micro_group": sys_.schedule.micro_group,
        "speculation": sys_.speculation, "host_ledger": sys_.ledger.to_dict(),
        "clip_expect": sys_.problem.clip_expect, "rollback": sys_.problem.rollback, "step_s_predicted_if": _both_ways(sys_),
    })
    rec["remat"] = remat_record(sys_)
    if sys_.zero_stage:  # bytes each rank sends through collectives per step (ring algorithms)
        import jax
        import jax.numpy as jnp
        ab = jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32)
        rec["comm_bytes_per_step_per_rank_accounted"] = sys_.step_fn.comm_bytes_per_step(ab)
    if sys_.problem.storage is not None:
        rec["storage"] = storage_record(sys_)
    if rec.get("step_s_median") and t.step_s:
        rec["step_time_ratio_measured_over_predicted"] = rec["step_s_median"] / t.step_s
    return rec


def remat_record(sys_) -> dict:
    """The schedule's remat choice (``"full"`` or blocks per option) and, with ``--set remat`` other than
    ``full``, the plan's predicted step and peak at the run's effective budget for each mode
    (:data:`chunkjax.plan_remat.REMAT_MODES`; ``auto``: the set it picks)."""
    from chunkjax import fit
    from chunkjax.plan_remat import REMAT_MODES, label
    out = {"mode": sys_.problem.remat, "chosen": label(sys_.schedule.remat), "names": list(sys_.schedule.remat_names)}
    if sys_.problem.remat == "full":
        return out
    for mode in REMAT_MODES:
        try:
            s = fit.plan(dataclasses.replace(sys_.problem, remat=mode), sys_.effective_budget)
            out[mode] = {"remat": label(s.remat), "step_s_predicted": s.predicted.time.step_s,
                         "peak_device_bytes_accounted": s.predicted.peak_device_bytes,
                         "activation_bytes": s.predicted.time.activation_bytes,
                         "recompute_saved_s": s.predicted.time.recompute_saved_s}
        except Exception as e:  # a mode that does not fit: its one line
            out[mode] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    return out


def _retime_kw(sys_) -> dict | None:
    """The keywords that retime the plan as it was planned (:func:`chunkjax.clip_plan.retime_keywords`:
    one device without micro-batches or storage chunks, else None)."""
    from chunkjax.clip_plan import retime_keywords
    return retime_keywords(sys_.problem, sys_.schedule)


def _bound(sys_) -> dict:
    """``speculation_params`` and ``backup_bytes_per_param`` of the built step's speculation
    (:func:`chunkjax.clip_plan.bound_keywords`; unbounded without a step or on several devices)."""
    from chunkjax.clip_plan import bound_keywords
    return bound_keywords(sys_.problem, getattr(sys_, "step_fn", None))


def _bound_record(sys_) -> dict:
    """The record's ``speculation_bound`` (:func:`chunkjax.clip_plan.bound_record`): the step's bound
    (bytes, None: its default), the chunks and parameters it lets speculate (None: unbounded or no
    speculation) and the backup bytes per parameter."""
    from chunkjax.clip_plan import bound_record
    step = getattr(sys_, "step_fn", None)
    return bound_record(_bound(sys_), sys_.problem.layout.chunk_size, getattr(step, "speculation_bytes", None),
                        getattr(step, "rollback", None))


def reported_time(sys_):
    """The run's predicted step (:class:`chunkjax.cost.PipelinedStepTime`,
    :func:`chunkjax.clip_plan.predicted_time`, as the fit path's report): the plan's, except for a
    plan timed with the speculation holding (``clip_expect`` ``"rare"``) whose step speculates
    (clipping or a non-finite skip): that plan retimed with the step's bound
    (:func:`chunkjax.clip_plan.speculation_bound`: only the chunks the backup pool or the kept
    gradients' bound holds update before the norm is known, the rest after the backward). The
    planner's own figure (every host chunk speculating, for free) is the record's ``step_s_planned``."""
    from chunkjax.clip_plan import predicted_time
    return predicted_time(sys_.problem, sys_.schedule, _bound(sys_))


def _both_ways(sys_) -> dict | None:
    """The plan's predicted step if clipping fires and if it is rare, the rare case with the step's
    speculation bound (:func:`chunkjax.clip_plan.both_ways`; one device without micro-batches or
    storage chunks, else None)."""
    from chunkjax.clip_plan import both_ways
    kw = _retime_kw(sys_)
    return None if kw is None else both_ways(sys_.schedule, sys_.problem.cb_rank, **kw, **_bound(sys_))


def _storage(args):
    """The worker's ``--storage`` / ``--no-storage-keep-previous`` as :class:`chunkjax.StorageOptions`."""
    if not getattr(args, "storage", ""):
        return None
    from chunkjax.storage.updater import StorageOptions
    return StorageOptions(tuple(d for d in args.storage.split(",") if d),
                          keep_previous=getattr(args, "storage_keep_previous", True))


def storage_record(sys_) -> dict:
    """The disk tier of a run: the plan's line and predictions beside the measured disk bytes and
    rate per step (the last timed steps' near-storage updates) and the workers' peak RSS."""
    from chunkjax.plan_disk import storage_line
    p = sys_.schedule.predicted
    out = {"dirs": list(sys_.problem.storage.dirs), "storage_devices": sys_.problem.storage_devices,
           "keep_previous": sys_.problem.storage.keep_previous,
           "disk_budget_bytes": sys_.problem.disk_budget_bytes, "storage_chunks": p.storage_chunks,
           "line": storage_line(sys_.schedule, sys_.problem.storage_devices, sys_.problem.host_budget_bytes),
           "disk_bytes_per_step_accounted": p.disk_bytes_per_step, "storage_update_s_predicted": p.time.storage_update_s,
           "storage_exposed_s_predicted": p.time.storage_exposed_s,
           "staging_buffers": sys_.problem.storage.staging_buffers, "host_bytes_accounted": p.host_bytes}
    if sys_.disk is not None:
        sys_.disk.wait()  # the last step's writes and commit
        sys_.disk_steps = list(sys_.disk.history)
    done = [r for r in sys_.disk_steps if r is not None and not r.skipped]
    if done:
        moved = [sum(r.storage_link_bytes.values()) for r in done]
        # update_s: from the step's header (the reads start with the step) to the commit, so the GB/s are a
        # lower bound of the disk's rate (the forward and backward are inside)
        out.update(disk_bytes_per_step_measured=moved[-1], storage_update_s_measured=[r.update_s for r in done],
                   storage_exposed_s_measured=list(sys_.disk.exposed_s),
                   disk_gb_per_s_measured=[b / r.update_s / 1e9 for b, r in zip(moved, done) if r.update_s])
    if sys_.disk is not None:
        rss = []
        for pid in sys_.disk.opt.worker_pids:
            try:
                with open(f"/proc/{pid}/status") as f:
                    rss += [int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:")]
            except OSError:
                pass
        out["workers_rss_peak_bytes_measured"] = rss
    return out
