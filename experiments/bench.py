"""Issue-4 benchmark: chunkjax side by side with plain JAX and the static offloads users run today.

    python -m experiments.bench --model GPT3_6B --batch 32 --seq 1024 --device-budget 24GiB \\
        --systems plain_jax,maxtext_style,zero_offload_style,chunkjax --steps 5 --run-id g36b_24g
    python -m experiments.bench --largest --systems chunkjax --device-budget 100GiB --run-id largest1 \\
        [--largest-models GPT3_10B,GPT3_12B,GPT3_15B]
    python -m experiments.bench --largest --systems chunkjax --device-budget 120GiB --storage scratch/disk \\
        --largest-models GPT3_18B,GPT3_20B --largest-steps 3 --run-id largest_disk    # past host RAM: the disk tier
    python -m experiments.bench --report experiments/results/bench_g36b_24g.json   # tables + plot

Baseline knobs (``--set``): ``maxtext_donate=false`` (no state donation in maxtext_style),
``zero_grads_to_host=false`` (zero_offload_style's gradients leave the program in device memory
and are copied afterwards). chunkjax knobs (``experiments.bench_chunkjax.run_chunkjax``):
``micro_batches=4``, ``max_grad_norm=1.0``, ``cross_step=0`` (the joined step), ``segments=N``,
``unroll_micro_batches=1`` / ``=0`` (an in-program plan's micro-batch loops traced unrolled and timed
so, or while loops: ``chunkjax.schedule.Schedule.unroll_micro_batches``; default ``"auto"``: unrolled
up to ``chunkjax.plan_micro.UNROLL_AUTO_MAX_MICRO_BATCHES``). ``BENCH_KEEP_TRACE_DIR=<dir>`` in the environment keeps each system's
profiler trace (``<system>_<model>_b<batch>.perfetto_trace.json.gz``) for inspection.

The driver runs the matmul-rate probe in its own subprocess, then every system in its own
subprocess (a clean ``peak_bytes_in_use`` and its own memory settings), with
``XLA_PYTHON_CLIENT_MEM_FRACTION = budget / card memory``, ``XLA_PYTHON_CLIENT_PREALLOCATE=false``
and ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` lifted (``--host-limit-gb``). A system first compiles its
step and compares the compiled peak (argument + output + temp - alias bytes of the device program)
with the budget: above it, the system is recorded ``feasible: false`` with the compiled bytes and
is not run. Otherwise: one warm-up step, ``--steps`` timed steps (each waited for), one extra step
under the profiler (bytes moved each way; GPU only), ``peak_bytes_in_use``, the host bytes the
system keeps, and ``update_s`` where the update is timed separately (``zero_offload_style``).
A crashed or killed worker (out of memory included) is recorded ``feasible: false`` with the tail
of its stderr; the driver never crashes on it.

Results go to ``<results-dir>/bench_<run_id>.json``. A run may span several driver calls with
the same ``--run-id`` (one call per GPU-machine command): systems are merged into the file, the
matmul probe is repeated in each call and recorded per call, and each system's MFU uses the rate
measured in its own call. Settings are identical for every system (issue 4, item 2): AdamW lr
1e-4, no clipping or loss scaling, bf16 compute with fp32 master params, remat per block, random
tokens (``jax.random.randint`` over the vocabulary, fixed seed; the same batch every step), the
batch as one micro-batch.

The ``chunkjax`` system is ``experiments/bench_chunkjax.py: run_chunkjax(args) -> dict`` (imported
lazily; ``args`` is the worker's namespace: model, batch, seq, steps, seed, budget_bytes,
host_limit_gb, compile_only, run_id, and any ``--set KEY=VALUE`` given to the driver). It returns the same keys as the baselines; the easiest way
is to wrap chunkjax in an object with the :class:`experiments.baselines.BaselineSystem` interface
(``init``, ``step``, ``compiled_memory``, ``host_bytes``) and call
:func:`experiments.measure.measure_system`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

from experiments.measure import PROGRESS_TAG, measure_system, mem_fraction_env, partial_from_progress
from experiments.report import ANCHOR_KEYS

#: The worker's host-ledger lines on stderr (:meth:`chunkjax.host_ledger.HostLedger.line`).
LEDGER_TAG = "[host-ledger]"

SYSTEMS_ALL = ("plain_jax", "maxtext_style", "zero_offload_style", "chunkjax")
BASELINES = ("plain_jax", "maxtext_style", "zero_offload_style")
STATIC_OFFLOADS = ("maxtext_style", "zero_offload_style")

#: Per-system keys required by issue 4 (every worker returns all of them; null where unknown).
REQUIRED_KEYS = ("tokens_per_s", "mfu", "tflops", "peak_device_bytes_measured", "h2d_bytes_per_step_measured",
                 "d2h_bytes_per_step_measured", "update_s", "host_bytes", "feasible")
#: Per-system keys of a run.
RUN_KEYS = ("losses", "step_s_median", "step_s_all", "error")
#: Further keys every record carries (null where not applicable).
EXTRA_KEYS = ("system", "model", "batch", "seq", "device_budget_bytes", "mfu_datasheet", "matmul_tflops", "call",
              "losses_finite", "loss_falling", "compiled_memory", "infeasible_reason", "compile_s", "init_s",
              "device_state_bytes", "timings", "transfer_source", "transfer_detail",
              "h2d_bytes_per_step_nvml_estimate", "d2h_bytes_per_step_nvml_estimate", "bytes_limit_measured",
              "mem_fraction", "host_rss_peak_bytes_measured", "platform", "device_kind", "notes", "wall_s")
#: The anchors' units (issue 23 item 4; :func:`experiments.report.anchor_units`): model TFLOP/s at 6N
#: per token, its share of 989 TFLOP/s, MFU against the call's matmul probe, host bytes per parameter.
ALL_KEYS = REQUIRED_KEYS + RUN_KEYS + EXTRA_KEYS + ANCHOR_KEYS

#: Configs tried by ``--largest`` when ``--largest-models`` is not given (sorted by N there).
DEFAULT_LARGEST_MODELS = ("GPT3_6B", "GPT3_8B", "GPT3_10B", "GPT3_12B", "GPT3_15B", "GPT3_18B")
#: Tried after them with ``--storage`` (past host RAM: the disk tier), from models/gpt.py.
STORAGE_LARGEST_MODELS = ("GPT3_19B", "GPT3_20B", "GPT3_40B")

#: The plan's figures a ``--largest`` summary keeps beside the measured ones (from the chunkjax record).
LARGEST_PLAN_KEYS = ("step_s_predicted", "peak_device_bytes_accounted", "host_bytes_accounted", "host_budget_bytes",
                     "effective_budget_bytes", "schedule_counts", "micro_batches", "segments",
                     "host_bytes_per_param_accounted", "host_resident_bytes_per_param", "model_bytes_per_param")

DEFAULT_HOST_LIMIT_GB = 110
DEFAULT_MEM_FRACTION = 0.75  # XLA's default device pool fraction
_STDERR_TAIL_LINES = 40


def default_host_limit_gb(env=None) -> int:
    """The pinned-host cap (GiB) the workers get when ``--host-limit-gb`` is not given: the
    environment's ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` when it is an integer, else
    :data:`DEFAULT_HOST_LIMIT_GB`. (Session 12: ``XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE=true
    XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=40`` reached the worker as a preallocated 110 GiB pool, the
    default having replaced the 40, and GPT3_15B was refused needing 176 GB.)"""
    raw = (os.environ if env is None else env).get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "")
    try:
        return int(raw) if str(raw).strip() else DEFAULT_HOST_LIMIT_GB
    except ValueError:
        return DEFAULT_HOST_LIMIT_GB


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


def parse_bytes(text: str) -> int:
    """``"24GiB"``, ``"512MiB"``, ``"24GB"``, ``"1e9"`` or ``"123456"`` -> bytes.

    Raises:
      ValueError: unparsable or not positive.
    """
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    t = str(text).strip().lower().replace(" ", "")
    m = re.fullmatch(r"([0-9.eE+\-]+?)([a-z]*)", t)
    try:
        val = float(m.group(1)) if m else None
    except ValueError:
        val = None
    unit = m.group(2) if m else None
    if val is None or unit not in units or not math.isfinite(val) or val <= 0:
        raise ValueError(f"cannot parse {text!r} as a positive byte size: use e.g. 24GiB, 512MiB, 24GB or a byte count")
    return int(val * units[unit])


# ---- records -------------------------------------------------------------------------------

def empty_record(system: str) -> dict:
    """A record with every key of :data:`ALL_KEYS`, nothing measured, ``feasible: false``."""
    rec = {k: None for k in ALL_KEYS}
    rec.update(system=system, feasible=False, notes=[])
    return rec


def normalize_record(rec: dict, system: str) -> dict:
    """Exactly :data:`ALL_KEYS` (missing ones null) plus ``extra`` holding any other keys."""
    out = empty_record(system)
    extra = dict(rec.get("extra") or {})
    for k, v in rec.items():
        if k == "extra":
            continue
        if k in out:
            out[k] = v
        else:
            extra[k] = v
    out["system"] = system
    out["feasible"] = bool(out["feasible"])
    out["notes"] = list(out["notes"] or [])
    out["extra"] = extra
    return out


def finalize_record(rec: dict, flops_per_token: int, matmul_tflops: float | None, call: int | None,
                    n_params: int | None = None) -> dict:
    """Fill ``tflops``, ``mfu`` (against the call's matmul rate) and ``mfu_datasheet`` (990 TFLOP/s)
    from ``tokens_per_s`` (6N + 12LSh FLOPs per token), and with ``n_params`` the anchors' units
    (:data:`ANCHOR_KEYS`: 6N per token, 989 TFLOP/s, the same call's matmul rate, host bytes per
    parameter); record the rate and call index used."""
    from experiments.gpu_measure import DATASHEET_BF16_FLOPS
    from experiments.report import anchor_units

    tps = rec.get("tokens_per_s")
    rec["matmul_tflops"] = matmul_tflops
    rec["call"] = call
    if tps:
        flops = flops_per_token * tps
        # several devices (ZeRO over a host's GPUs): MFU per device against one device's rate
        nd = rec.get("n_devices") or (rec.get("extra") or {}).get("n_devices") or 1
        rec["tflops"] = flops / 1e12
        rec["mfu"] = flops / nd / (matmul_tflops * 1e12) if matmul_tflops else None
        rec["mfu_datasheet"] = flops / nd / DATASHEET_BF16_FLOPS
    if n_params:
        nd = rec.get("n_devices") or (rec.get("extra") or {}).get("n_devices") or 1
        rec.update(anchor_units(tps, n_params, matmul_tflops=matmul_tflops, host_bytes=rec.get("host_bytes"),
                                n_devices=nd))
    return rec


# ---- the worker (one system, one process): the protocol is experiments/measure.py


def _import_run_chunkjax():
    try:
        from experiments.bench_chunkjax import run_chunkjax
    except ModuleNotFoundError as e:
        if e.name in ("experiments.bench_chunkjax",):
            raise RuntimeError("the chunkjax system needs experiments/bench_chunkjax.py defining "
                               "run_chunkjax(args) -> dict (same keys as the baselines; see "
                               "experiments.measure.measure_system): the file does not exist yet") from None
        raise RuntimeError(f"experiments/bench_chunkjax.py failed to import: {type(e).__name__}: {e}") from e
    except ImportError as e:
        raise RuntimeError(f"experiments/bench_chunkjax.py has no usable run_chunkjax(args): {e}") from e
    return run_chunkjax


def run_worker(args) -> dict:
    """Measure one system (``args.worker``) in this process; returns a normalised record.

    Never raises for a failure of the system itself: an exception (out of memory included) gives
    ``feasible: false`` and ``error`` with the traceback's last lines.
    """
    system = args.worker
    t_start = time.time()
    rec: dict = {}
    try:
        from models import gpt
        cfg = gpt.get_config(args.model)
        if system == "chunkjax":
            rec = dict(_import_run_chunkjax()(args) or {})
        else:
            from experiments import baselines
            kw = {}
            if system == "zero_offload_style" and getattr(args, "zero_h2d_path", None):
                kw["h2d_path"] = args.zero_h2d_path
            if system == "zero_offload_style" and hasattr(args, "zero_grads_to_host"):
                kw["grads_to_host"] = bool(args.zero_grads_to_host)
            if system == "maxtext_style" and hasattr(args, "maxtext_donate"):
                kw["donate"] = bool(args.maxtext_donate)
            rec = measure_system(baselines.build(system, cfg, **kw), args)
    except Exception as e:
        tb = traceback.format_exc().strip().splitlines()
        rec = dict(rec, feasible=False, error=f"{type(e).__name__}: {e}"[:2000],
                   extra={"traceback_tail": tb[-_STDERR_TAIL_LINES:]})
    rec = normalize_record(rec, system)
    rec.update(model=args.model, batch=args.batch, seq=args.seq, device_budget_bytes=args.budget_bytes,
               wall_s=time.time() - t_start)
    try:
        from models import gpt
        cfg = gpt.get_config(args.model)
        finalize_record(rec, cfg.flops_per_token(args.seq), None, None, cfg.n_params)
    except Exception:
        pass
    return rec


def run_probe(args) -> dict:
    """The matmul rate and the card: ``matmul_tflops``, ``matmul_n``, ``platform``,
    ``device_kind``, ``jax_version``, ``bytes_limit`` (device pool at this process's fraction),
    ``card_bytes`` (nvidia-smi's total, else bytes_limit / fraction), ``host_mem_bytes``."""
    import jax

    from experiments import gpu_measure as gm

    d = jax.devices()[0]
    out = {"platform": d.platform, "device_kind": d.device_kind, "jax_version": jax.__version__,
           "host_mem_bytes": _host_memory_bytes()}
    n = args.matmul_n if d.platform != "cpu" else min(args.matmul_n, 1024)
    stats = gm.memory_stats() or {}
    frac = float(mem_fraction_env() or DEFAULT_MEM_FRACTION)
    out["bytes_limit"] = int(stats["bytes_limit"]) if "bytes_limit" in stats else None
    out["card_bytes_from_limit"] = int(out["bytes_limit"] / frac) if out["bytes_limit"] else None
    out["card_bytes_nvidia_smi"] = nvidia_smi_total_bytes() if d.platform == "gpu" else None
    out["card_bytes"] = out["card_bytes_nvidia_smi"] or out["card_bytes_from_limit"]
    out["matmul_n"] = n
    out["matmul_tflops"] = gm.matmul_tflops(n)
    return out


def nvidia_smi_total_bytes() -> int | None:
    """The first GPU's memory in bytes as nvidia-smi reports it, None without nvidia-smi."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
        return int(r.stdout.split()[0]) * 2 ** 20
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def _host_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ---- the driver ----------------------------------------------------------------------------

def probe_env() -> dict:
    """Environment of the probe subprocess: the default fraction made explicit (so bytes_limit /
    0.75 is the card; without a fraction variable newer XLA may apply a growth policy)."""
    env = dict(os.environ)
    env.pop("XLA_CLIENT_MEM_FRACTION", None)  # jaxlib refuses both names at once
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(DEFAULT_MEM_FRACTION)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return env


def worker_env(budget_bytes: int, card_bytes: int | None, host_limit_gb: int, preallocate: bool = False) -> dict:
    """Environment of a system's subprocess: the budget as the device memory fraction (when the
    card's size is known), no preallocation unless ``preallocate`` (then the budget is reserved as
    one allocator region at start-up), the pinned-host cap lifted. The fraction goes in
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (the name train.py uses); ``XLA_CLIENT_MEM_FRACTION`` (the
    newer name) is removed because jaxlib refuses both at once. jax's persistent compilation cache
    is on (``JAX_COMPILATION_CACHE_DIR``, unless set) so that a program compiled for the memory
    check is not compiled again for the first step."""
    env = dict(os.environ)
    # preallocate: the whole budget reserved as one allocator region at start-up, so that a
    # program's temp buffer (one contiguous allocation) cannot fail on a pool grown in pieces
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true" if preallocate else "false"
    env["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] = str(int(host_limit_gb))
    # the compile-check (lower().compile()) and the first call compile the same programs: let
    # the second hit jax's persistent compilation cache
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "chunkjax_xla_cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    if card_bytes:
        env.pop("XLA_CLIENT_MEM_FRACTION", None)
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{min(budget_bytes / card_bytes, 0.99):.6f}"
    return env


def stream_process(cmd: list[str], env: dict | None, timeout: float | None, cwd: str | None = None,
                   echo_prefixes: tuple[str, ...] = (), log_path: str | None = None) -> tuple[int, str, str, bool]:
    """Run ``cmd`` to completion or ``timeout`` seconds; its stderr lines that start
    with one of ``echo_prefixes`` are printed on this process's stdout as they arrive, so the
    driver's log keeps a worker's progress even when the driver itself is killed. ``log_path``:
    every stderr line is also written there as it comes, prefixed with the seconds since the start.
    On a timeout the child gets SIGABRT first (a worker has :mod:`faulthandler` on: its threads'
    Python stacks land in stderr, so the log says where it was), then SIGKILL after
    :data:`ABORT_GRACE_S`. Returns ``(rc, stdout, stderr, timed_out)``; rc 124 on a timeout. Never
    raises for the child's failure."""
    import signal
    import threading

    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         errors="replace")
    out_lines: list[str] = []
    err_lines: list[str] = []

    t0 = time.monotonic()
    log = open(log_path, "w", buffering=1) if log_path else None

    def read(stream, sink, echo, log):
        for line in stream:
            sink.append(line)
            if log is not None:
                log.write(f"{time.monotonic() - t0:9.1f} {line}")
            if echo and line.startswith(echo_prefixes):
                print(line.rstrip("\n"), flush=True)

    readers = [threading.Thread(target=read, args=(p.stdout, out_lines, False, None), daemon=True),
               threading.Thread(target=read, args=(p.stderr, err_lines, bool(echo_prefixes), log), daemon=True)]
    for t in readers:
        t.start()
    timed_out = False
    try:
        rc = p.wait(timeout=timeout or None)
    except subprocess.TimeoutExpired:
        timed_out, rc = True, 124
        p.send_signal(signal.SIGABRT)
        try:
            p.wait(timeout=ABORT_GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for t in readers:
        t.join(timeout=10)
    if log is not None:
        log.close()
    return rc, "".join(out_lines), "".join(err_lines), timed_out


#: Seconds a timed-out child has after SIGABRT (its stacks written) before SIGKILL.
ABORT_GRACE_S = 5.0


def subprocess_runner(argv: list[str], env: dict, timeout: float | None, log_path: str | None = None) -> dict:
    """Run ``python -m experiments.bench <argv> --out FILE``; returns ``{"rc", "json" (the parsed
    FILE or None), "stderr_tail", "stdout_tail", "progress" (the worker's progress lines),
    "ledger" (its host-ledger lines: :class:`chunkjax.host_ledger.HostLedger`), "timed_out",
    "wall_s"}``. The progress and ledger lines are also echoed as they come, and the whole stderr
    goes to ``log_path`` when given (:func:`stream_process`). Never raises for a failure of the child."""
    fd, out_path = tempfile.mkstemp(prefix="bench_", suffix=".json")
    os.close(fd)
    os.unlink(out_path)
    cmd = [sys.executable, "-m", "experiments.bench", *argv, "--out", out_path]
    t0 = time.time()
    rc, out, err, timed_out = stream_process(cmd, env, timeout, os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                             echo_prefixes=(PROGRESS_TAG, LEDGER_TAG), log_path=log_path)
    data = None
    if os.path.exists(out_path):
        try:
            with open(out_path) as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            data = None
        os.unlink(out_path)
    tail = lambda s: s.strip().splitlines()[-_STDERR_TAIL_LINES:]
    return {"rc": rc, "json": data, "stderr_tail": tail(err), "stdout_tail": tail(out)[-10:],
            "progress": [l for l in err.splitlines() if l.startswith(PROGRESS_TAG)],
            "ledger": [l for l in err.splitlines() if l.startswith(LEDGER_TAG)],
            "timed_out": timed_out, "wall_s": time.time() - t0}


#: Seconds a ``--time-limit`` keeps back from each worker for the driver to write its record.
TIME_LIMIT_MARGIN_S = 10.0


def worker_timeout(args) -> float | None:
    """Seconds the next subprocess may run: ``--worker-timeout`` (0: none), cut to what is left of
    ``--time-limit`` (measured from the driver's start, ``args.started_at``) less
    :data:`TIME_LIMIT_MARGIN_S`, at least 1 s; None when neither is set."""
    limits = [float(args.worker_timeout)] if args.worker_timeout else []
    if getattr(args, "time_limit", 0):
        left = args.time_limit - (time.monotonic() - args.started_at) - TIME_LIMIT_MARGIN_S
        limits.append(max(1.0, left))
    return min(limits) if limits else None


def system_budget(args, system: str) -> int:
    """The device budget of ``system``: its ``--system-budget`` override, else ``--device-budget``."""
    return int((getattr(args, "system_budgets", None) or {}).get(system, args.budget_bytes))


def _worker_argv(args, system: str, model: str, batch: int, seq: int, steps: int, compile_only: bool) -> list[str]:
    argv = ["--worker", system, "--model", model, "--batch", str(batch), "--seq", str(seq), "--steps", str(steps),
            "--budget-bytes", str(system_budget(args, system)), "--seed", str(args.seed), "--host-limit-gb",
            str(args.host_limit_gb), "--run-id", args.run_id]
    if compile_only:
        argv.append("--compile-only")
    for kv in args.set:
        argv += ["--set", kv]
    if args.zero_h2d_path:
        argv += ["--zero-h2d-path", args.zero_h2d_path]
    if system == "chunkjax" and args.storage:
        argv += ["--storage", args.storage] + ([] if args.storage_keep_previous else ["--no-storage-keep-previous"])
    if system == "chunkjax" and args.host_budget != "auto":
        argv += ["--host-budget", args.host_budget]
    return argv


def _run_system(args, runner, probe: dict, system: str, model: str, batch: int, seq: int, steps: int,
                compile_only: bool, call: int) -> dict:
    from models import gpt

    budget = system_budget(args, system)
    env = worker_env(budget, probe.get("card_bytes"), args.host_limit_gb, getattr(args, "preallocate", False))
    print(f"[bench] {system}: {model} batch {batch} x {seq}, budget {budget} B, "
          f"fraction {env.get('XLA_PYTHON_CLIENT_MEM_FRACTION', '(default)')}", flush=True)
    timeout = worker_timeout(args)
    log_path = os.path.join(args.results_dir, f"{args.run_id}_{system}_{model}.stderr.log") if args.results_dir else None
    argv = _worker_argv(args, system, model, batch, seq, steps, compile_only)
    res = runner(argv, env, timeout, log_path)
    if res.get("json") is not None and res["rc"] == 0:
        rec = normalize_record(res["json"], system)
    else:
        rec = empty_record(system)
        why = (f"worker timed out after {timeout:.0f} s" if res.get("timed_out")
               else f"worker exited with status {res['rc']}")
        if res.get("json") is not None:  # wrote a record, then died
            rec = normalize_record(res["json"], system)
            rec["feasible"] = False
        part = partial_from_progress(res.get("progress") or res.get("stderr_tail") or [], batch, seq) if res.get("timed_out") else {}
        if part.get("tokens_per_s"):  # it trained: keep the steps it finished, say so
            rec.update(part, feasible=True)
            rec["notes"] = list(rec.get("notes") or []) + [
                f"worker timed out after {timeout:.0f} s having finished {len(part['step_s_all'])} timed "
                "step(s): tokens/s from those; no profiled step (bytes moved, peak not measured)"]
        else:
            rec.update(part)
        rec["error"] = None if part.get("tokens_per_s") else why + ": " + "\n".join(
            l for l in (res.get("stderr_tail") or []) if not l.startswith(PROGRESS_TAG))[-4000:]
        if res.get("ledger"):  # a worker killed (the OOM killer) before writing its record: its plan and RSS
            rec["host_ledger_lines"] = list(res["ledger"])
            print("\n".join(f"[bench] {system}: {l}" for l in res["ledger"]), flush=True)
        rec = normalize_record(rec, system)
        rec.update(model=model, batch=batch, seq=seq, device_budget_bytes=budget)
    rec["mem_fraction"] = rec.get("mem_fraction") or env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    cfg = gpt.get_config(model)
    finalize_record(rec, cfg.flops_per_token(seq), probe.get("matmul_tflops"), call, cfg.n_params)
    status = ("feasible" if rec["feasible"] else "INFEASIBLE") + (f", error: {rec['error'][:160]!r}" if rec.get("error") else "")
    tps = rec.get("tokens_per_s") if rec["feasible"] else None
    print(f"[bench] {system}: {status}; tokens/s {tps:,.0f}" if tps else f"[bench] {system}: {status}", flush=True)
    if tps and (rec.get("extra") or {}).get("step_s_predicted"):  # measured beside the plan's predictions
        print(f"[bench] {system}: {predicted_line(rec)}", flush=True)
    return rec


def predicted_line(rec: dict) -> str:
    """One line: step time, peak host RSS and (disk tier) disk bytes and rate, measured beside the
    plan's predictions (chunkjax's record: the predictions are in its ``extra``)."""
    gb = lambda b: f"{b / 1e9:.1f} GB" if b else "n/a"  # noqa: E731
    ex = rec.get("extra") or {}
    out = (f"step {rec['step_s_median']:.2f} s (predicted {ex['step_s_predicted']:.2f} s); peak host RSS "
           f"{gb(rec.get('host_rss_peak_bytes_measured'))} (predicted "
           f"{gb(((ex.get('host_ledger') or {}).get('accounted') or {}).get('predicted_peak_bytes'))}; host bytes "
           f"accounted {gb(ex.get('host_bytes_accounted'))})")
    st = ex.get("storage")
    if st and not st.get("storage_chunks"):
        out += f"; {st.get('line', 'no storage chunks')}"
    elif st:
        rates = st.get("disk_gb_per_s_measured") or []
        secs = st.get("storage_update_s_measured") or []
        out += (f"; {st.get('line', str(st['storage_chunks']) + ' storage chunks')}; disk "
                f"{gb(st.get('disk_bytes_per_step_measured'))}/step (accounted "
                f"{gb(st.get('disk_bytes_per_step_accounted'))}), update {secs[-1] if secs else float('nan'):.2f} s "
                f"(predicted {st.get('storage_update_s_predicted', float('nan')):.2f} s, exposed "
                f"{(st.get('storage_exposed_s_measured') or [float('nan')])[-1]:.2f} s, predicted "
                f"{st.get('storage_exposed_s_predicted', float('nan')):.2f} s) = "
                f"{rates[-1] if rates else float('nan'):.2f} "
                f"GB/s; workers' peak RSS {gb(sum(st.get('workers_rss_peak_bytes_measured') or []))}")
    return out


def results_path(results_dir: str, run_id: str) -> str:
    return os.path.join(results_dir, f"bench_{run_id}.json")


def load_results(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def write_json_atomic(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1, default=str)
        fh.write("\n")
    os.replace(tmp, path)


def merge_call(results: dict | None, *, run_id: str, call_info: dict, run_fields: dict | None,
               systems: dict, largest: dict | None) -> dict:
    """Merge one driver call into a run's results (``results`` None: a new run).

    ``run_fields`` (model, n_params, batch, seq, device_budget_bytes) must equal the run's where
    both are set. Systems replace earlier records of the same name; ``largest`` merges per system
    and model. ``matmul_tflops`` is the median over the calls' probes.

    Raises:
      UsageError: the run already holds a different model, batch, seq or budget.
    """
    res = results or {"run_id": run_id, "model": None, "n_params": None, "batch": None, "seq": None,
                      "device_budget_bytes": None, "matmul_tflops": None, "jax_version": None, "device_kind": None,
                      "commands": [], "calls": [], "systems": {}, "largest": {}}
    if run_fields:
        for k, v in run_fields.items():
            if res.get(k) is not None and res[k] != v:
                raise UsageError(f"run {run_id!r} already holds {k}={res[k]!r} (this call: {v!r}): "
                                 "use a new --run-id for a different setting")
        for k, v in run_fields.items():
            res[k] = v
    res["calls"].append(call_info)
    if call_info.get("command") and call_info["command"] not in res["commands"]:
        res["commands"].append(call_info["command"])
    rates = [c["matmul_tflops"] for c in res["calls"] if c.get("matmul_tflops")]
    res["matmul_tflops"] = statistics.median(rates) if rates else None
    res["jax_version"] = call_info.get("jax_version") or res.get("jax_version")
    res["device_kind"] = call_info.get("device_kind") or res.get("device_kind")
    res["systems"].update(systems)
    res["losses_vs_plain_jax"] = compare_losses(res["systems"])
    for system, block in (largest or {}).items():
        cur = res["largest"].setdefault(system, {"tried": {}})
        for k, v in block.items():
            if k != "tried":
                cur[k] = v
        cur["tried"].update(block.get("tried", {}))
        _summarize_largest(cur)
    return res


def compare_losses(systems: dict, reference: str = "plain_jax") -> dict:
    """Step-by-step loss agreement of each system with ``reference``, where both start from the
    same params: the baselines always do (``init_master_piecewise``); chunkjax when run with
    ``--set init=init_params`` (its record's ``init``). Returns ``{system: {"steps",
    "max_abs_diff", "max_rel_diff"}}`` over the steps both recorded; ``{}`` without a reference.
    bf16 compute gives differences of order 1e-3 relative; a wrong update gives far more.
    """
    ref = (systems.get(reference) or {}).get("losses") or []
    out = {}
    for name, rec in systems.items():
        losses = (rec or {}).get("losses") or []
        if name == reference or not ref or not losses:
            continue
        init = rec.get("init") or (rec.get("extra") or {}).get("init")  # normalised records keep it in extra
        if name == "chunkjax" and init != "init_params":
            continue  # leaf-wise init: other params, not comparable step by step
        n = min(len(ref), len(losses))
        diffs = [abs(a - b) for a, b in zip(losses[:n], ref[:n])]
        out[name] = {"steps": n, "max_abs_diff": max(diffs),
                     "max_rel_diff": max(d / max(abs(r), 1e-30) for d, r in zip(diffs, ref[:n]))}
    return out


def _summarize_largest(block: dict) -> None:
    from models import gpt

    ok = [m for m, r in block["tried"].items() if r.get("ok")]
    best = max(ok, key=lambda m: gpt.get_config(m).n_params) if ok else None
    block["largest"] = best
    block["largest_n_params"] = gpt.get_config(best).n_params if best else None
    # the plan's own figures (none for a system without a plan): model data at the plan's bytes
    # per parameter, the host bytes it accounted and its host bytes per host-resident parameter
    t = block["tried"][best] if best else {}
    per = t.get("model_bytes_per_param")
    block["largest_model_bytes"] = int(per * block["largest_n_params"]) if per else None
    block["largest_host_bytes_accounted"] = t.get("host_bytes_accounted")
    block["largest_host_resident_bytes_per_param"] = t.get("host_resident_bytes_per_param")


def run_largest(args, runner, probe: dict, call: int) -> dict:
    """For each system of ``--systems``, try the configs of ``--largest-models`` in increasing N at
    ``--largest-batch`` x ``--largest-seq`` for ``--largest-steps`` steps; a config is ``ok`` when
    it is feasible with finite, falling loss (``--compile-only``: when it compiles within the
    budget). Stops at a system's first failure unless ``--largest-keep-going``.

    Returns ``{system: {"batch", "seq", "steps", "device_budget_bytes", "compile_only",
    "tried": {model: summary}}}``.
    """
    from models import gpt

    names = (args.largest_models.split(",") if args.largest_models
             else list(DEFAULT_LARGEST_MODELS) + list(STORAGE_LARGEST_MODELS if args.storage else ()))
    models = sorted((gpt.get_config(n).name for n in names), key=lambda n: gpt.get_config(n).n_params)
    out = {}
    for system in args.systems:
        block = {"batch": args.largest_batch, "seq": args.largest_seq, "steps": args.largest_steps,
                 "device_budget_bytes": args.budget_bytes, "compile_only": args.compile_only, "tried": {}}
        for m in models:
            rec = _run_system(args, runner, probe, system, m, args.largest_batch, args.largest_seq,
                              args.largest_steps, args.compile_only, call)
            if args.compile_only:
                ok = bool(rec["feasible"]) and not rec.get("error")
            else:
                ok = bool(rec["feasible"] and rec.get("losses_finite") and rec.get("loss_falling"))
            block["tried"][m] = {"ok": ok, "n_params": gpt.get_config(m).n_params, "feasible": rec["feasible"],
                                 "losses": rec.get("losses"), "tokens_per_s": rec.get("tokens_per_s"),
                                 "peak_device_bytes_measured": rec.get("peak_device_bytes_measured"),
                                 "compiled_peak_bytes": (rec.get("compiled_memory") or {}).get("peak_bytes"),
                                 "host_bytes": rec.get("host_bytes"),
                                 "host_rss_peak_bytes_measured": rec.get("host_rss_peak_bytes_measured"),
                                 "storage": (rec.get("extra") or {}).get("storage"),
                                 # RSS by kind at each phase beside the plan's host parts (a killed worker: its lines)
                                 "host_ledger": (rec.get("extra") or {}).get("host_ledger")
                                 or (rec.get("extra") or {}).get("host_ledger_lines"),
                                 "step_s_median": rec.get("step_s_median"),
                                 **{k: (rec.get("extra") or {}).get(k) for k in LARGEST_PLAN_KEYS},
                                 "infeasible_reason": rec.get("infeasible_reason"),
                                 "error": (rec.get("error") or None) and rec["error"][:2000], "call": call}
            if not ok and not args.largest_keep_going:
                break
        out[system] = block
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="GPT2_1B", help="config name from models/gpt.py (default: GPT2_1B)")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step, one micro-batch (default: 16)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default: 1024)")
    ap.add_argument("--device-budget", default="24GiB", help="peak device bytes, e.g. 24GiB (default: 24GiB)")
    ap.add_argument("--systems", default=",".join(SYSTEMS_ALL),
                    help=f"comma-separated subset of {','.join(SYSTEMS_ALL)}, or 'none' (default: all)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up (default: 5)")
    ap.add_argument("--run-id", default=None, help="results go to bench_<run-id>.json; calls with one id merge")
    ap.add_argument("--results-dir", default="experiments/results", help="(default: experiments/results)")
    ap.add_argument("--seed", type=int, default=0, help="init and token seed (default: 0)")
    ap.add_argument("--matmul-n", type=int, default=8192, help="matmul probe size (default: 8192; capped at 1024 on a CPU)")
    ap.add_argument("--host-limit-gb", type=int, default=default_host_limit_gb(),
                    help="XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB for every system (default: the variable's value when set "
                         f"in the environment, else {DEFAULT_HOST_LIMIT_GB})")
    ap.add_argument("--worker-timeout", type=float, default=0, help="seconds per system subprocess, 0: none (default: 0)")
    ap.add_argument("--time-limit", type=float, default=0,
                    help="seconds for the whole call (probe and every system); each subprocess gets what is left less "
                         f"{TIME_LIMIT_MARGIN_S:.0f} s, so a worker that runs out leaves its finished steps in the "
                         "record (0: none; default: 0)")
    ap.add_argument("--preallocate", action="store_true",
                    help="reserve each worker's budget as one allocator region at start-up "
                         "(XLA_PYTHON_CLIENT_PREALLOCATE=true; default: grow on demand)")
    ap.add_argument("--compile-only", action="store_true", help="only compile and check the budget (no steps)")
    ap.add_argument("--zero-h2d-path", choices=("via_pinned", "numpy", "direct"), default=None,
                    help="zero_offload_style: how new bf16 params reach the device (default: via_pinned)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra worker setting (repeatable), e.g. --set segments=2: becomes args.KEY in the worker "
                         "(VALUE parsed as JSON when it parses, else kept as text); run_chunkjax reads what it knows")
    ap.add_argument("--system-budget", action="append", default=[], metavar="SYSTEM=BYTES",
                    help="a device budget for one system (repeatable), e.g. chunkjax=8GiB beside plain_jax at the "
                         "run's --device-budget: with --set init=init_params the losses compare step by step")
    ap.add_argument("--largest", action="store_true", help="largest-model mode (see run_largest)")
    ap.add_argument("--largest-models", default=None,
                    help=f"comma-separated configs (default: {','.join(DEFAULT_LARGEST_MODELS)}; with --storage "
                    f"also {','.join(STORAGE_LARGEST_MODELS)})")
    ap.add_argument("--largest-batch", type=int, default=8)
    ap.add_argument("--largest-seq", type=int, default=1024)
    ap.add_argument("--largest-steps", type=int, default=5)
    ap.add_argument("--largest-keep-going", action="store_true", help="try every config even after a failure")
    ap.add_argument("--storage", default="", metavar="DIR[,DIR...]",
                    help="chunkjax: storage directories (one per disk) for the disk tier: chunks whose master params "
                         "and optimizer state the host budget cannot hold are updated next to the disk; --largest then "
                         "climbs past host RAM (default: none)")
    ap.add_argument("--storage-keep-previous", action=argparse.BooleanOptionalAction, default=True,
                    help="keep the last committed step's chunk files until the next step commits (twice the state on "
                         "disk); --no-storage-keep-previous: the state once on disk (default: keep)")
    ap.add_argument("--host-budget", default="auto",
                    help="chunkjax: host bytes for model data, e.g. 100GiB; auto: what MemAvailable leaves (default: auto)")
    ap.add_argument("--update-docs", action="store_true", help="also rewrite this run's section of docs/benchmarks.md")
    ap.add_argument("--docs", default="docs/benchmarks.md", help="(default: docs/benchmarks.md)")
    ap.add_argument("--report", default=None, metavar="JSON", help="only (re)write docs tables and plot from a results JSON")
    # internal: one subprocess per system / probe
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--budget-bytes", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return ap


def _validate(args) -> None:
    from models import gpt

    try:
        cfg = gpt.get_config(args.model)
    except ValueError as e:
        raise UsageError(str(e)) from None
    args.model = cfg.name
    args.system_budgets = {}
    for kv in args.system_budget:
        name, sep, val = kv.partition("=")
        if not sep or name not in SYSTEMS_ALL:
            raise UsageError(f"--system-budget {kv!r}: use SYSTEM=BYTES with SYSTEM one of {', '.join(SYSTEMS_ALL)}")
        args.system_budgets[name] = parse_bytes(val)
    for name in ("batch", "seq", "steps", "largest_batch", "largest_seq", "largest_steps", "matmul_n"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.host_budget != "auto":
        try:
            parse_bytes(args.host_budget)
        except ValueError as e:
            raise UsageError(f"--host-budget: {e}") from None
    if args.storage:
        from chunkjax.storage.updater import storage_options
        try:
            storage_options(args.storage)
        except ValueError as e:
            raise UsageError(f"--storage: {e}") from None
    if not args.largest and args.seq > cfg.seq_len:
        raise UsageError(f"--seq {args.seq} exceeds {cfg.name}'s {cfg.seq_len} positions")
    if args.budget_bytes is None:
        try:
            args.budget_bytes = parse_bytes(args.device_budget)
        except ValueError as e:
            raise UsageError(f"--device-budget: {e}") from None
    systems = [] if args.systems.strip().lower() in ("", "none") else [s.strip() for s in args.systems.split(",")]
    bad = [s for s in systems if s not in SYSTEMS_ALL]
    if bad:
        raise UsageError(f"unknown system(s) {', '.join(bad)}: choose from {', '.join(SYSTEMS_ALL)}")
    args.systems = systems
    if args.largest_models:
        for n in args.largest_models.split(","):
            try:
                gpt.get_config(n)
            except ValueError as e:
                raise UsageError(f"--largest-models: {e}") from None
    if args.run_id is None:
        args.run_id = f"{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}-{cfg.name}"
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", args.run_id):
        raise UsageError(f"--run-id {args.run_id!r}: use letters, digits, '_', '-', '.'")


def drive(args, argv: list[str], runner=subprocess_runner) -> dict:
    """One driver call: probe, each system (or the largest-model mode), merge into the run's JSON.
    Returns the merged results."""
    from models import gpt

    path = results_path(args.results_dir, args.run_id)
    existing = load_results(path)
    call = len(existing["calls"]) if existing else 0
    command = "python -m experiments.bench " + shlex.join(argv)
    print(f"[bench] run {args.run_id} call {call}: {command}", flush=True)
    pres = runner(["--probe", "--matmul-n", str(args.matmul_n)], probe_env(), worker_timeout(args))
    probe = pres.get("json") or {}
    if not probe:
        print("[bench] matmul probe failed: " + "\n".join(pres.get("stderr_tail") or []), file=sys.stderr, flush=True)
    print(f"[bench] matmul {probe.get('matmul_tflops')} TFLOP/s, card {probe.get('card_bytes')} B, "
          f"{probe.get('device_kind')}", flush=True)
    call_info = {"call": call, "time": datetime.datetime.now().isoformat(timespec="seconds"), "command": command,
                 "systems": list(args.systems), "largest": bool(args.largest),
                 "preallocate": bool(getattr(args, "preallocate", False)), **probe}
    systems, largest, run_fields = {}, None, None
    if args.largest:
        largest = run_largest(args, runner, probe, call)
    else:
        cfg = gpt.get_config(args.model)
        run_fields = {"model": cfg.name, "n_params": cfg.n_params, "batch": args.batch, "seq": args.seq,
                      "device_budget_bytes": args.budget_bytes}
        if existing:  # refuse a mismatched run before spending device time
            merge_call(json.loads(json.dumps(existing)), run_id=args.run_id, call_info={}, run_fields=run_fields,
                       systems={}, largest=None)
        for system in args.systems:
            systems[system] = _run_system(args, runner, probe, system, cfg.name, args.batch, args.seq, args.steps,
                                          args.compile_only, call)
    results = merge_call(load_results(path), run_id=args.run_id, call_info=call_info, run_fields=run_fields,
                         systems=systems, largest=largest)
    write_json_atomic(path, results)
    print(f"[bench] wrote {path}", flush=True)
    if args.update_docs:
        update_docs(path, args.docs)
    return results


def main(argv=None, runner=subprocess_runner) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.started_at = time.monotonic()
    for kv in args.set:
        key, sep, val = kv.partition("=")
        if not sep or not key.isidentifier() or hasattr(args, key):
            print(f"error: --set {kv!r}: use KEY=VALUE with a new identifier KEY", file=sys.stderr)
            return 2
        try:
            setattr(args, key, json.loads(val))
        except ValueError:
            setattr(args, key, val)
    if args.worker or args.probe:
        if args.worker:
            import faulthandler
            faulthandler.enable()  # a driver's SIGABRT at its time limit: the stacks go to stderr (stream_process)
            if args.budget_bytes is None:
                args.budget_bytes = parse_bytes(args.device_budget)
            rec = run_worker(args)
        else:
            rec = run_probe(args)
        if args.out:
            write_json_atomic(args.out, rec)
        else:
            print(json.dumps(rec, default=str))
        return 0
    try:
        if args.report:
            if not os.path.exists(args.report):
                raise UsageError(f"--report {args.report}: no such file")
            update_docs(args.report, args.docs)
            return 0
        _validate(args)
        if not args.systems:
            raise UsageError("--systems is empty: name at least one system")
        drive(args, argv, runner)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


# ---- docs: tables and plot -----------------------------------------------------------------

def _fmt(v, scale=1.0, digits=2, suffix=""):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v / scale:,.{digits}f}{suffix}"


def _ratio(a, b):
    return a / b if a and b else None


def render_markdown(results: dict, results_file: str, plot_file: str | None) -> str:
    """The markdown section of one run: a table per run with ratios vs plain_jax and vs the best
    static offload (the better of maxtext_style and zero_offload_style that ran), the exact
    commands, and the largest-model results."""
    rid = results["run_id"]
    lines = [f"<!-- bench:{rid}:start -->", f"## Benchmark run `{rid}`"]
    sysd = results.get("systems") or {}
    if sysd:
        gib = 2 ** 30
        lines += ["", f"{results['model']} (N = {results['n_params']:,}), batch {results['batch']} x {results['seq']}, "
                      f"device budget {_fmt(results['device_budget_bytes'], gib)} GiB "
                      f"({results['device_budget_bytes']:,} B); {results.get('device_kind')}, jax "
                      f"{results.get('jax_version')}; matmul rate (median over calls) "
                      f"{_fmt(results.get('matmul_tflops'), digits=1)} TFLOP/s. AdamW lr 1e-4, no clipping, bf16 "
                      f"compute with fp32 master, remat per block, random tokens. Results: `{results_file}`."]
        plain = sysd.get("plain_jax", {})
        plain_tps = plain.get("tokens_per_s") if plain.get("feasible") else None
        static = [sysd[s].get("tokens_per_s") for s in STATIC_OFFLOADS
                  if s in sysd and sysd[s].get("feasible") and sysd[s].get("tokens_per_s")]
        best_static = max(static) if static else None
        lines += ["", "| system | feasible | tokens/s | step s | TFLOP/s | MFU | MFU (990T) | model TFLOP/s (6N) "
                      "| of 989T | model MFU | peak device GiB (measured) | compiled peak GiB | H2D GB/step | "
                      "D2H GB/step | update s | host GiB | host B/param | x plain_jax | x best static offload |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        order = [s for s in SYSTEMS_ALL if s in sysd] + [s for s in sysd if s not in SYSTEMS_ALL]
        for s in order:
            r = sysd[s]
            tps = r.get("tokens_per_s") if r.get("feasible") else None
            cm = (r.get("compiled_memory") or {}).get("peak_bytes")
            lines.append("| " + " | ".join([
                s, "yes" if r.get("feasible") else "**no**", _fmt(tps, digits=0), _fmt(r.get("step_s_median"), digits=3),
                _fmt(r.get("tflops"), digits=1), _fmt(r.get("mfu"), digits=3), _fmt(r.get("mfu_datasheet"), digits=3),
                _fmt(r.get("model_tflops"), digits=1), _fmt(r.get("model_tflops_share_989"), digits=3),
                _fmt(r.get("model_mfu"), digits=3),
                _fmt(r.get("peak_device_bytes_measured"), gib), _fmt(cm, gib),
                _fmt(r.get("h2d_bytes_per_step_measured"), 1e9), _fmt(r.get("d2h_bytes_per_step_measured"), 1e9),
                _fmt(r.get("update_s"), digits=3), _fmt(r.get("host_bytes"), gib),
                _fmt(r.get("host_bytes_per_param"), digits=1),
                _fmt(_ratio(tps, plain_tps), digits=2, suffix="x"), _fmt(_ratio(tps, best_static), digits=2, suffix="x"),
            ]) + " |")
        notes = []
        for s in order:
            r = sysd[s]
            why = r.get("infeasible_reason") or r.get("error")
            if why:
                notes.append(f"- `{s}`: {why.strip().splitlines()[0][:300]}")
            if r.get("transfer_source") and r["transfer_source"] != "profiler":
                notes.append(f"- `{s}`: bytes moved from {r['transfer_source']} (an estimate)")
        if notes:
            lines += ["", *notes]
        lines += _phase_lines(sysd, order)
        cmp = results.get("losses_vs_plain_jax") or {}
        if cmp:
            lines += ["", "Losses step by step against plain_jax (same initial params):", ""]
            lines += [f"- `{s}`: {c['steps']} steps, largest difference {c['max_abs_diff']:.4f} "
                      f"({c['max_rel_diff']:.1e} relative)" for s, c in cmp.items()]
            for s in ("plain_jax", *cmp):
                ls = (sysd.get(s) or {}).get("losses") or []
                lines.append(f"- `{s}` losses: " + ", ".join(f"{x:.4f}" for x in ls))
        if plot_file:
            lines += ["", f"![tokens/s per system]({plot_file})"]
    largest = results.get("largest") or {}
    for system, block in largest.items():
        lines += ["", f"Largest model for `{system}` (batch {block.get('batch')} x {block.get('seq')}, "
                      f"{block.get('steps')} steps, budget {block.get('device_budget_bytes'):,} B"
                      f"{', compile only' if block.get('compile_only') else ''}): **{block.get('largest') or 'none'}**"
                      + (f" (N = {block['largest_n_params']:,}{_largest_plan_text(block)})" if block.get("largest") else ""),
                  "", "| model | N | ok | tokens/s | peak device GiB (measured) | compiled peak GiB | host GiB | "
                      "losses (first -> last) / reason |", "|---|---|---|---|---|---|---|---|"]
        from models import gpt
        for m in sorted(block["tried"], key=lambda n: gpt.get_config(n).n_params):
            t = block["tried"][m]
            why = t.get("infeasible_reason") or t.get("error") or ""
            losses = t.get("losses")
            loss_text = " -> ".join(f"{x:.3f}" for x in (losses[0], losses[-1])) if losses else ""
            info = loss_text if (t["ok"] or not why) else why.strip().splitlines()[0][:200]
            lines.append(f"| {m} | {t['n_params']:,} | {'yes' if t['ok'] else 'no'} | {_fmt(t.get('tokens_per_s'), digits=0)} "
                         f"| {_fmt(t.get('peak_device_bytes_measured'), 2**30)} | {_fmt(t.get('compiled_peak_bytes'), 2**30)} "
                         f"| {_fmt(t.get('host_bytes'), 2**30)} | {info or '-'} |")
    lines += ["", "Commands:", "", "```", *results.get("commands", []), "```", f"<!-- bench:{rid}:end -->"]
    return "\n".join(lines) + "\n"


def _largest_plan_text(block: dict) -> str:
    """The plan's figures of a ``--largest`` block's largest model, for its heading (empty without a plan)."""
    out, t = "", block["tried"][block["largest"]]
    if block.get("largest_model_bytes"):
        out += f", model data {block['largest_model_bytes'] / 2**30:.1f} GiB at {t['model_bytes_per_param']:.0f} B/param"
    if block.get("largest_host_bytes_accounted") is not None:
        out += f", host {block['largest_host_bytes_accounted'] / 2**30:.1f} GiB planned"
        if block.get("largest_host_resident_bytes_per_param"):
            out += f" ({block['largest_host_resident_bytes_per_param']:.2f} B/param of its host-resident chunks)"
    return out


def _phase_lines(sysd: dict, order) -> list[str]:
    """Per program of the profiled step (:func:`experiments.gpu_measure.transfer_phases`): time,
    bytes and GB/s each way, the copy-only share (copies running while no kernel computes) and
    whether the program is transfer-bound."""
    lines = []
    for s in order:
        tp = ((sysd[s].get("extra") or {}).get("transfer_phases") or sysd[s].get("transfer_phases") or {})
        phases = [p for p in tp.get("phases") or [] if p["duration_s"] >= 1e-3 or p["h2d_bytes"] or p["d2h_bytes"]]
        if not phases:
            continue
        lines += ["", f"Transfers per program of `{s}`'s profiled step (PCIe 54 GB/s per direction):", "",
                  "| program | s | H2D GB | D2H GB | H2D GB/s (avg / while busy) | D2H GB/s (avg / while busy) | "
                  "copy-only share | transfer-bound |", "|---|---|---|---|---|---|---|---|"]
        for p in phases + ([dict(tp["step"], phase="whole step")] if tp.get("step") else []):
            lines.append(f"| {p['phase']} | {p['duration_s']:.3f} | {p['h2d_bytes'] / 1e9:.2f} | {p['d2h_bytes'] / 1e9:.2f} | "
                         f"{p['h2d_gb_s']:.1f} / {_fmt(p.get('h2d_gb_s_while_busy'), digits=1)} | "
                         f"{p['d2h_gb_s']:.1f} / {_fmt(p.get('d2h_gb_s_while_busy'), digits=1)} | "
                         f"{_fmt(p.get('copy_only_fraction'), digits=3)} | {', '.join(p.get('transfer_bound') or []) or 'no'} |")
    return lines


def plot_tokens(results: dict, png_path: str) -> str | None:
    """Bar plot of tokens/s per system (infeasible systems drawn at 0 and labelled). Returns the
    path, or None when the run has no systems."""
    sysd = results.get("systems") or {}
    if not sysd:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = [s for s in SYSTEMS_ALL if s in sysd] + [s for s in sysd if s not in SYSTEMS_ALL]
    vals = [(sysd[s].get("tokens_per_s") or 0) if sysd[s].get("feasible") else 0 for s in order]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bars = ax.bar(order, vals, color=["#4c72b0" if v else "#cccccc" for v in vals])
    for b, v, s in zip(bars, vals, order):
        ax.annotate(f"{v:,.0f}" if v else ("infeasible" if not sysd[s].get("feasible") else "n/a"),
                    (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{results['model']}, batch {results['batch']} x {results['seq']}, budget "
                 f"{results['device_budget_bytes'] / 2**30:.0f} GiB ({results.get('device_kind')})", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


def update_docs(results_file: str, docs_path: str = "docs/benchmarks.md") -> str:
    """Write (or replace) the run's section in ``docs_path`` and its plot next to it
    (``bench_<run_id>_tokens.png``). Returns the section text."""
    results = load_results(results_file)
    rid = results["run_id"]
    docs_dir = os.path.dirname(os.path.abspath(docs_path))
    png = plot_tokens(results, os.path.join(docs_dir, f"bench_{rid}_tokens.png"))
    rel_results = os.path.relpath(os.path.abspath(results_file), os.path.dirname(docs_dir))
    section = render_markdown(results, rel_results, os.path.basename(png) if png else None)
    from experiments.report import replace_marked_section
    os.makedirs(docs_dir, exist_ok=True)
    replace_marked_section(docs_path, f"<!-- bench:{rid}:start -->", f"<!-- bench:{rid}:end -->", section)
    return section


if __name__ == "__main__":
    sys.exit(main())
