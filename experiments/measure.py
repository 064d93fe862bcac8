"""The measurement protocol of one system in one process (the benchmark's worker, the sweep).

A *system* is any object with the BaselineSystem interface (experiments/baselines.py):
``cfg``, ``init(key)``, ``step(state, batch) -> (state, loss)``, ``compiled_memory(batch)``,
``host_bytes(state)``, optionally ``dev_sh`` (the batch's sharding), ``notes``,
``device_state_bytes``, ``last_update_s``, ``last_timings``. :func:`measure_system` compiles,
checks the compiled peak against the budget, initialises, times the steps, profiles one step on a
GPU (bytes moved) and reads the peaks. experiments/bench.py (the driver) and
experiments/bench_chunkjax.py (the chunkjax system) both use it; it imports neither.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time


def mem_fraction_env() -> str | None:
    """The XLA device-pool fraction set in the environment (either variable name), or None."""
    return os.environ.get("XLA_CLIENT_MEM_FRACTION") or os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")



def make_batch(cfg, batch: int, seq: int, seed: int, sharding=None):
    """Random tokens int32 (batch, seq + 1) over the vocabulary, fixed by ``seed``."""
    import jax
    import jax.numpy as jnp

    b = jax.random.randint(jax.random.key(seed + 1), (batch, seq + 1), 0, cfg.vocab_size, dtype=jnp.int32)
    return jax.device_put(b, sharding) if sharding is not None else b


def _host_rss_peak_bytes() -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


PROGRESS_TAG = "[bench-progress]"


def _progress(**kw) -> None:
    """One JSON line on stderr per finished phase of the worker (compile, init, each step), so a
    worker killed by ``--worker-timeout`` still leaves what it measured (:func:`partial_from_progress`)."""
    print(PROGRESS_TAG, json.dumps(kw, default=float), file=sys.stderr, flush=True)


def partial_from_progress(lines: list[str], batch: int, seq: int) -> dict:
    """What a timed-out worker measured, from its :func:`_progress` lines: ``compile_s``,
    ``init_s``, ``warmup_s`` (the first step, not timed as the others), the plan's predictions
    (the ``plan`` line's keys, e.g. ``step_s_predicted``), the losses with ``losses_finite`` and
    ``loss_falling``, and when at least one timed step finished, ``step_s_all``,
    ``step_s_median``, ``tokens_per_s`` (batch * seq / median step seconds) and ``update_s``.
    Returns {} when no line is found."""
    rec: dict = {}
    steps, updates, losses = [], [], []
    for line in lines:
        if not line.startswith(PROGRESS_TAG):
            continue
        try:
            d = json.loads(line[len(PROGRESS_TAG):])
        except ValueError:
            continue
        if "loss" in d:
            losses.append(d["loss"])
        if d.get("phase") == "plan":  # the plan's predictions (the system's plan_progress), kept beside
            rec.update({k: v for k, v in d.items() if k != "phase"})
        elif d.get("phase") in ("compile", "init", "warmup") and "seconds" in d:
            rec[d["phase"] + "_s"] = d["seconds"]
        elif d.get("phase") == "step":
            steps.append(d["seconds"])
            if d.get("update_s") is not None:
                updates.append(d["update_s"])
    if losses:
        rec["losses"] = losses
        rec["losses_finite"] = all(math.isfinite(x) for x in losses)
        rec["loss_falling"] = bool(losses[-1] < losses[0]) if len(losses) > 1 else None
    if steps:
        med = statistics.median(steps)
        rec.update(step_s_all=steps, step_s_median=med, tokens_per_s=batch * seq / med,
                   update_s=statistics.median(updates) if updates else None)
    return rec


def profile_one_step(system, state, batch, keep_trace_to: str | None = None):
    """One ``system.step`` under the profiler (:func:`experiments.gpu_measure.profile_transfer_bytes`);
    returns (the new state, the profile dict; its ``result`` is the step's loss as a float)."""
    import jax

    from experiments import gpu_measure as gm

    box = {"state": state}

    def one_step():
        s, l = system.step(box["state"], batch)
        jax.block_until_ready((s, l))
        box["state"] = s
        return float(l)

    prof = gm.profile_transfer_bytes(one_step, keep_trace_to=keep_trace_to)
    return box["state"], prof


def measure_system(system, args) -> dict:
    """The measurement protocol for any object with the BaselineSystem interface.

    Compiles (``system.compiled_memory``) and stops with ``feasible: false`` if the compiled peak
    exceeds ``args.budget_bytes`` (or after compiling when ``args.compile_only``). Otherwise
    ``init``, one warm-up step, ``args.steps`` timed steps (``block_until_ready`` each), then on a
    GPU one profiled step (bytes moved) and ``peak_bytes_in_use``. Returns a partial record
    (keys of :data:`ALL_KEYS`, and ``grad_norms``, the global gradient norm of the warm-up and each
    timed step, read after its timing, for systems with a ``last_grad_norm``); the caller
    normalises it.

    ``args`` needs: model, batch, seq, steps, seed, budget_bytes, compile_only (and optionally
    profile_on_cpu: run the profiled step on a CPU too, for tests).
    """
    import jax

    from experiments import gpu_measure as gm

    dev = jax.devices()[0]
    platform = dev.platform
    rec: dict = {"platform": platform, "device_kind": dev.device_kind,
                 "mem_fraction": mem_fraction_env(), "notes": []}
    stats = gm.memory_stats()
    if stats and "bytes_limit" in stats:
        rec["bytes_limit_measured"] = int(stats["bytes_limit"])
    sharding = getattr(system, "dev_sh", None)
    batch = make_batch(system.cfg, args.batch, args.seq, args.seed, sharding)

    t0 = time.perf_counter()
    mem = system.compiled_memory(batch)
    rec["compile_s"] = time.perf_counter() - t0
    _progress(phase="compile", seconds=rec["compile_s"])
    if hasattr(system, "plan_progress"):  # a killed worker's record keeps the plan it measured against
        _progress(phase="plan", **system.plan_progress())
    rec["compiled_memory"] = mem
    rec["notes"] += list(getattr(system, "notes", []))
    if mem.get("fits") is False:  # the system's own check (e.g. chunkjax's headroom) failed
        rec["feasible"] = False
        rec["infeasible_reason"] = mem.get("why") or "the system's compiled-memory check failed"
        return rec
    if mem["peak_bytes"] > args.budget_bytes:
        rec["feasible"] = False
        rec["infeasible_reason"] = (f"compiled peak {mem['peak_bytes']} B (argument {mem['argument_bytes']} + output "
                                    f"{mem['output_bytes']} + temp {mem['temp_bytes']} - alias {mem['alias_bytes']}) "
                                    f"> budget {args.budget_bytes} B")
        return rec
    if getattr(args, "compile_only", False):
        rec["feasible"] = True
        rec["notes"].append("compile only: fits the budget by the compiled memory analysis; not run")
        return rec

    t0 = time.perf_counter()
    state = system.init(jax.random.key(args.seed))
    jax.block_until_ready(state)
    rec["init_s"] = time.perf_counter() - t0
    _progress(phase="init", seconds=rec["init_s"])
    rec["host_bytes"] = int(system.host_bytes(state))
    if hasattr(system, "device_state_bytes"):
        rec["device_state_bytes"] = int(system.device_state_bytes(state))

    losses = []
    t0 = time.perf_counter()
    state, loss = system.step(state, batch)  # warm-up
    jax.block_until_ready((state, loss))
    losses.append(float(loss))
    rec["warmup_s"] = time.perf_counter() - t0
    grad_norms = []  # read after each step's timing: the global norm clipping compares (systems that report it)
    if getattr(system, "last_grad_norm", None) is not None:
        grad_norms.append(float(system.last_grad_norm))
    _progress(phase="warmup", seconds=rec["warmup_s"], loss=losses[-1])
    step_s, update_s, timings = [], [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, loss = system.step(state, batch)
        jax.block_until_ready((state, loss))
        step_s.append(time.perf_counter() - t0)
        losses.append(float(loss))
        if getattr(system, "last_grad_norm", None) is not None:
            grad_norms.append(float(system.last_grad_norm))
        if getattr(system, "last_update_s", None) is not None:
            update_s.append(system.last_update_s)
        if getattr(system, "last_timings", None):
            timings.append(dict(system.last_timings))
        _progress(phase="step", seconds=step_s[-1], loss=losses[-1], update_s=getattr(system, "last_update_s", None))
    med = statistics.median(step_s)
    rec.update(step_s_all=step_s, step_s_median=med, tokens_per_s=args.batch * args.seq / med,
               update_s=statistics.median(update_s) if update_s else None)
    if grad_norms:
        rec["grad_norms"] = grad_norms
    if timings:
        rec["timings"] = {k: statistics.median(t[k] for t in timings) for k in timings[0]}

    if platform != "cpu" or getattr(args, "profile_on_cpu", False):
        keep = os.environ.get("BENCH_KEEP_TRACE_DIR")
        keep = os.path.join(keep, f"{getattr(system, 'name', 'system')}_{args.model}_b{args.batch}.perfetto_trace.json.gz") \
            if keep else None
        state, prof = profile_one_step(system, state, batch, keep)
        losses.append(prof["result"])
        if prof.get("calls", 1) > 1:
            rec["notes"].append(f"profiled {prof['calls']} steps (no GPU events with the tracers off; "
                                "retried with the profiler's default options)")
        nv = prof.get("nvml") or {}
        rec["h2d_bytes_per_step_nvml_estimate"] = nv.get("h2d_bytes_estimate")
        rec["d2h_bytes_per_step_nvml_estimate"] = nv.get("d2h_bytes_estimate")
        if prof["n_device_events"] > 0 and not prof["profiler_error"]:
            rec["transfer_source"] = "profiler"
            rec["h2d_bytes_per_step_measured"] = prof["h2d_bytes"]
            rec["d2h_bytes_per_step_measured"] = prof["d2h_bytes"]
        elif nv.get("available"):
            rec["transfer_source"] = f"nvml_estimate ({nv.get('method')})"
            rec["h2d_bytes_per_step_measured"] = nv.get("h2d_bytes_estimate")
            rec["d2h_bytes_per_step_measured"] = nv.get("d2h_bytes_estimate")
        rec["transfer_detail"] = {k: prof.get(k) for k in (
            "n_h2d", "n_d2h", "other_bytes", "n_other", "n_device_events", "gpu_processes", "n_unrecognized",
            "unrecognized", "n_api_skipped", "events", "copy_kernel_samples", "profiler_error", "nvml", "attempts",
            "trace_file")}
        rec["transfer_detail"]["events"] = (prof.get("events") or [])[:4]
        rec["transfer_phases"] = prof.get("transfer_phases")  # GB/s per program, transfer-bound ones
    if hasattr(system, "finish"):  # the final wait: no background work of the last step left running at exit
        system.finish(state)
    rec["peak_device_bytes_measured"] = gm.peak_device_bytes()
    rec["host_rss_peak_bytes_measured"] = _host_rss_peak_bytes()
    rec["losses"] = losses
    rec["losses_finite"] = all(math.isfinite(x) for x in losses)
    rec["loss_falling"] = bool(losses[-1] < losses[0]) if len(losses) > 1 else None
    rec["feasible"] = True
    if not rec["losses_finite"]:
        rec["error"] = f"non-finite loss: {losses}"
    rec["notes"] = list(dict.fromkeys(rec["notes"] + list(getattr(system, "notes", []))))
    del state
    return rec
