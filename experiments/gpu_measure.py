"""Measurements the benchmark takes from the hardware and runtime, independently of chunkjax.

- :func:`matmul_tflops`: the ``matmul_rate`` of definitions.md (bf16 n x n x n ``jnp.dot``,
  3 warm-ups, median of 10).
- :func:`peak_device_bytes`: ``peak_bytes_in_use`` of the device allocator (None on the CPU).
- :func:`profile_transfer_bytes`: host <-> device bytes of one call, summed from the GPU memcpy
  events of a ``jax.profiler`` trace, with an NVML PCIe-counter estimate alongside.
- :func:`parse_trace_transfers`: the trace parser itself (pure Python, unit-tested on synthetic
  traces of every format variant it accepts).

What the trace looks like (XLA's CUPTI tracer, read in openxla/xla
``xla/backends/profiler/gpu/cupti_buffer_events.cc`` and ``cupti_collector.cc``, and
``xla/tsl/profiler/convert/xplane_to_trace_events.cc``): each CUPTI memcpy *activity* becomes an
event named ``MemcpyH2D`` / ``MemcpyD2H`` / ``MemcpyD2D`` / ``MemcpyP2P`` / ``MemcpyOther`` on a
stream line of the ``/device:GPU:<n>`` plane, with a stat ``memcpy_details`` =
``"kind_src:<pinned|pageable|device|...> kind_dst:<...> size:<bytes> dest:<device> async:<0|1>"``.
The trace-viewer JSON (``*.trace.json.gz``; ``perfetto_trace.json.gz`` is the same minus its
``metadata`` key, see ``jax._src.profiler._write_perfetto_trace_file``) turns every stat into a
string in ``args``; process names come from ``ph: "M"`` ``process_name`` events. Driver-API
callbacks (``cuMemcpyHtoDAsync_v2``...) go to the ``/host:CUPTI`` plane, which the JSON converter
does not export; if they appear anyway they are not counted (the activity is the copy).
Older TensorFlow timelines wrote ``"MemcpyH2D bytes:N"``; Nsight/nvprof name copies
``[CUDA memcpy HtoD]`` / ``Memcpy HtoD (Pinned -> Device)`` with a ``bytes``/``size`` arg. The
parser accepts all of these and keeps raw samples of memcpy-like events it could not classify.
"""
from __future__ import annotations

import glob
import gzip
import inspect
import json
import os
import re
import statistics
import tempfile
import threading
import time
from typing import Callable

#: H200 SXM dense bf16 datasheet rate (definitions.md), FLOP/s.
DATASHEET_BF16_FLOPS = 990e12

# ---- matmul rate ---------------------------------------------------------------------------

#: Parameters of the host-kernel timing that calibrates the cost model (2**26: 1 GiB of buffers).
HOST_RATE_PARAMS = 2**26


def calibrated_rates(host_stats: dict | None = None):
    """``(rates, matmul TFLOP/s)``: the planner's :class:`chunkjax.cost.Rates` calibrated on this
    machine on a GPU (the matmul probe; the host AdamW kernel's seconds per parameter alone, and the
    step's host thread's rate ``host_update_loaded_s_per_param`` planned from it and from the kernel
    timed beside the device's compute and both PCIe directions:
    :func:`chunkjax.host_contention.planned_step_rate`); the default rates and None elsewhere. The
    main job and the benchmark plan with the same rates. ``host_stats``: filled with the host kernel
    timing's min, median and working set (:func:`chunkjax.host_update.measure_host_update_rate`'s
    ``stats``), the loaded timing's ``loaded_*`` figures
    (:func:`chunkjax.host_contention.measure_loaded_host_update_rate`) and
    ``planned_step_s_per_param`` on a GPU.

    Why both timings (session 26): each is one short timing on a busy machine; against the rate the
    step's host thread ran at over 12 GPT3_6B runs, the alone one (times 1.22) erred by up to 24 %,
    the loaded fastest call by up to 14 %, their geometric mean by up to 9 %. Before (sessions
    24-25): the loaded fastest call alone. ``docs/design.md``, "The host rate the plan assumes".
    """
    import jax

    from chunkjax.cost import Rates
    if jax.default_backend() != "gpu":
        return Rates(), None
    from chunkjax.host_contention import measure_loaded_host_update_rate, planned_step_rate
    from chunkjax.host_update import measure_host_update_rate
    stats = {} if host_stats is None else host_stats
    tflops = matmul_tflops()
    alone = measure_host_update_rate(HOST_RATE_PARAMS, stats=stats)
    measure_loaded_host_update_rate(HOST_RATE_PARAMS, stats=stats)
    planned = planned_step_rate(alone, float(stats.get("loaded_min_s_per_param") or 0.0))
    stats["planned_step_s_per_param"] = planned
    return Rates.calibrated(tflops * 1e12, alone, host_update_loaded_s_per_param=planned), tflops


def matmul_tflops(n: int = 8192, warmup: int = 3, reps: int = 10) -> float:
    """bf16 ``jnp.dot`` of two (n, n) standard-normal matrices: ``2 n^3 / median seconds / 1e12``
    (TFLOP/s).

    ``warmup`` untimed calls (the first compiles), then ``reps`` timed calls, each waited for
    with ``block_until_ready``. The definition fixes n = 8192; smaller n is for CPU tests.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)  # normal operands (not constants: data affects power and clocks)
    a, b = (jax.device_put(rng.standard_normal((n, n), np.float32).astype(jnp.bfloat16)) for _ in range(2))
    f = jax.jit(jnp.dot)
    for _ in range(warmup):
        f(a, b).block_until_ready()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(ts) / 1e12


# ---- device memory -------------------------------------------------------------------------


def memory_stats() -> dict | None:
    """``jax.devices()[0].memory_stats()`` (None on the CPU or where unsupported)."""
    import jax

    d = jax.devices()[0]
    if d.platform == "cpu":
        return None
    try:
        return d.memory_stats()
    except Exception:
        return None


def live_arrays_summary(top: int = 12) -> dict:
    """What holds device memory now (for an out-of-memory report): ``jax.live_arrays()`` grouped
    by (shape, dtype, memory kind), the ``top`` groups by bytes, plus totals per memory kind
    (bytes) and the allocator's ``memory_stats()``."""
    import jax

    groups: dict = {}
    per_kind: dict = {}
    for a in jax.live_arrays():
        try:
            kind = a.sharding.memory_kind or "device"
            n = int(a.nbytes)
        except Exception:
            continue
        k = (str(a.shape), str(a.dtype), kind)
        c, b = groups.get(k, (0, 0))
        groups[k] = (c + 1, b + n)
        per_kind[kind] = per_kind.get(kind, 0) + n
    rows = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    return {"bytes_per_memory_kind": per_kind,
            "largest_groups": [{"shape": k[0], "dtype": k[1], "memory_kind": k[2], "count": c, "bytes": b}
                               for k, (c, b) in rows],
            "memory_stats": memory_stats()}


def peak_device_bytes() -> int | None:
    """``peak_bytes_in_use`` of the first device since the process started (None on the CPU)."""
    s = memory_stats()
    if not s or "peak_bytes_in_use" not in s:
        return None
    return int(s["peak_bytes_in_use"])


# ---- trace parsing -------------------------------------------------------------------------

_H2D_NAME = re.compile(r"memcpy\s*_?h(ost)?\s*(2|to)\s*d(evice)?\b|\bhtod\b|host\s*to\s*device|\bh2d\b", re.I)
_D2H_NAME = re.compile(r"memcpy\s*_?d(evice)?\s*(2|to)\s*h(ost)?\b|\bdtoh\b|device\s*to\s*host|\bd2h\b", re.I)
_OTHER_COPY = re.compile(r"memcpy\s*_?(d2d|dtod|p2p|ptop|other)|device\s*to\s*device|peer", re.I)
_MEMCPY_LIKE = re.compile(r"memcpy|memcopy|htod|dtoh|h2d|d2h", re.I)
_COPY_KERNEL = re.compile(r"copy", re.I)  # XLA copy kernels / copy-start ops: sampled, never counted
_API_NAME = re.compile(r"^(cu|cuda|hip)[A-Z_]")  # cuMemcpyHtoDAsync_v2, cudaMemcpyAsync: host API calls
_SIZE_IN_TEXT = re.compile(r"\b(?:size|bytes|num_bytes|nbytes|Bytes)\s*[:=]\s*(\d+)")
_KIND_SRC = re.compile(r"kind_src\s*:\s*(\w+)")
_KIND_DST = re.compile(r"kind_dst\s*:\s*(\w+)")
_HOST_KINDS = {"pinned", "pageable", "host", "managed"}
_DEVICE_KINDS = {"device", "device_static", "array"}
_BYTE_ARG_KEYS = ("bytes", "num_bytes", "size", "Bytes", "Size", "nbytes", "bytes_transferred", "size_bytes")


def _load_trace(path) -> dict:
    path = os.fspath(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        data = json.load(fh)
    if isinstance(data, list):  # the bare JSON-array form of the Trace Event Format
        data = {"traceEvents": data}
    return data


def find_trace_file(log_dir: str) -> str | None:
    """The newest ``perfetto_trace.json.gz`` under ``log_dir`` (else the newest
    ``*.trace.json.gz``), or None."""
    for pattern in ("**/perfetto_trace.json.gz", "**/*.trace.json.gz", "**/*.trace.json"):
        files = glob.glob(os.path.join(log_dir, pattern), recursive=True)
        if files:
            return max(files, key=os.path.getmtime)
    return None


def _event_bytes(ev: dict) -> int | None:
    args = ev.get("args") or {}
    if isinstance(args, dict):
        for k in _BYTE_ARG_KEYS:
            if k in args:
                try:
                    return int(float(str(args[k]).replace(",", "")))
                except ValueError:
                    pass
        for v in args.values():  # memcpy_details "... size:N ...", or any "bytes:N" text
            m = _SIZE_IN_TEXT.search(str(v))
            if m:
                return int(m.group(1))
    m = _SIZE_IN_TEXT.search(str(ev.get("name", "")))  # "MemcpyH2D bytes:N" (TF timelines)
    return int(m.group(1)) if m else None


def _event_direction(ev: dict) -> str | None:
    """"h2d", "d2h", "other" (device-device, peer) or None (not recognised)."""
    name = str(ev.get("name", ""))
    args = ev.get("args") or {}
    text = " ".join(str(v) for v in args.values()) if isinstance(args, dict) else str(args)
    src, dst = _KIND_SRC.search(text), _KIND_DST.search(text)
    if src and dst:
        s, d = src.group(1).lower(), dst.group(1).lower()
        if s in _HOST_KINDS and d in _DEVICE_KINDS:
            return "h2d"
        if s in _DEVICE_KINDS and d in _HOST_KINDS:
            return "d2h"
        if s in _DEVICE_KINDS and d in _DEVICE_KINDS:
            return "other"
    for t in (name, str(args.get("long_name", "")) if isinstance(args, dict) else ""):
        if _OTHER_COPY.search(t):
            return "other"
        if _H2D_NAME.search(t):
            return "h2d"
        if _D2H_NAME.search(t):
            return "d2h"
    return None


def parse_trace_transfers(trace: dict | str, max_samples: int = 5) -> dict:
    """Sum host->device and device->host copy bytes in a Trace Event Format trace.

    Args:
      trace: the parsed JSON (a dict with ``traceEvents``, or the bare event list) or a path
        (``.json`` or ``.json.gz``).
      max_samples: raw events kept per kind of sample.

    Returns a dict: ``h2d_bytes``, ``d2h_bytes``, ``n_h2d``, ``n_d2h`` (ints), ``other_bytes``/
    ``n_other`` (device-device and peer copies, not counted), ``n_device_events`` (complete events
    on GPU processes: 0 means the GPU tracer recorded nothing), ``gpu_processes`` (names),
    ``events`` (the first raw counted events), ``unrecognized`` (raw memcpy-like events whose
    direction or size could not be read: look here when the counts look wrong),
    ``n_unrecognized``, ``n_api_skipped`` (driver/runtime API calls, not counted),
    ``copy_kernel_samples`` (a few non-memcpy events with "copy" in the name, e.g. XLA copy
    kernels: never counted, kept to diagnose copies that are not memcpy activities).

    Counting rule: when the trace has GPU processes (``/device:GPU:*``), only events on them
    count; otherwise every process's events are considered (e.g. an Nsight export). Events whose
    name is a CUDA/HIP API call (``cu...``, ``cuda...``) are never counted.
    """
    data = _load_trace(trace) if isinstance(trace, (str, os.PathLike)) else trace
    if isinstance(data, list):
        data = {"traceEvents": data}
    events = data.get("traceEvents", []) if isinstance(data, dict) else []
    proc_names: dict = {}
    for ev in events:
        if ev.get("ph") == "M" and ev.get("name") == "process_name":
            proc_names[ev.get("pid")] = str((ev.get("args") or {}).get("name", ""))
    gpu_pids = {pid for pid, n in proc_names.items() if re.search(r"/device:GPU|\bGPU\b|cuda", n, re.I)}
    out = {"h2d_bytes": 0, "d2h_bytes": 0, "n_h2d": 0, "n_d2h": 0, "other_bytes": 0, "n_other": 0,
           "n_device_events": 0, "gpu_processes": sorted(proc_names[p] for p in gpu_pids),
           "events": [], "unrecognized": [], "n_unrecognized": 0, "n_api_skipped": 0, "copy_kernel_samples": []}
    for ev in events:
        if ev.get("ph") not in ("X", "B", "i", "I", None):
            continue
        on_gpu = ev.get("pid") in gpu_pids
        if gpu_pids and not on_gpu:
            continue
        if on_gpu and ev.get("ph") == "X":
            out["n_device_events"] += 1
        name = str(ev.get("name", ""))
        args = ev.get("args") or {}
        memcpy_like = bool(_MEMCPY_LIKE.search(name)) or (isinstance(args, dict) and "memcpy_details" in args)
        if not memcpy_like:
            if _COPY_KERNEL.search(name) and len(out["copy_kernel_samples"]) < max_samples:
                out["copy_kernel_samples"].append(ev)
            continue
        if _API_NAME.match(name):
            out["n_api_skipped"] += 1
            continue
        direction, nbytes = _event_direction(ev), _event_bytes(ev)
        if direction is None or nbytes is None:
            out["n_unrecognized"] += 1
            if len(out["unrecognized"]) < max_samples:
                out["unrecognized"].append(ev)
            continue
        if direction == "other":
            out["other_bytes"] += nbytes
            out["n_other"] += 1
            continue
        out[f"{direction}_bytes"] += nbytes
        out[f"n_{direction}"] += 1
        if len(out["events"]) < 2 * max_samples:
            out["events"].append(ev)
    return out


def _union_us(intervals) -> float:
    """Length of the union of (start, end) intervals (microseconds)."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _module_runs(tagged) -> list:
    """Program intervals from kernel/copy events tagged with ``args.hlo_module`` (GPU traces
    without an "XLA Modules" thread): each maximal run of consecutive events of one module, in
    start order, is one execution ``(start, end, name)``."""
    runs = []
    for t0, t1, name in sorted(tagged):
        if runs and runs[-1][2] == name:
            runs[-1][1] = max(runs[-1][1], t1)
        else:
            runs.append([t0, t1, name])
    return [tuple(r) for r in runs]


def transfer_phases(trace: dict | str, bound_fraction: float = 0.9, link_gb_s: float = 54.0,
                    exposed_fraction: float = 0.5) -> dict:
    """Bytes and rates of host<->device copies per program (phase) of a profiled step.

    Phases are the XLA module executions on the GPU (events on a thread named "XLA Modules"); a
    copy belongs to the phase that contains its midpoint, else to ``"outside programs"``. Per
    phase: ``duration_s``, ``h2d_bytes`` / ``d2h_bytes``, ``h2d_busy_s`` / ``d2h_busy_s`` (union
    of that direction's copy intervals), ``h2d_gb_s`` / ``d2h_gb_s`` (bytes over the phase's
    duration), ``h2d_gb_s_while_busy`` / ``d2h_...`` (bytes over busy time), and
    ``copy_only_s`` / ``copy_only_fraction`` (copies running while no kernel computes), and
    ``transfer_bound``: a direction's copies were busy for at least ``bound_fraction`` of the
    phase, or copies ran with no kernel computing for at least ``exposed_fraction`` of it (the
    compute waited on PCIe). Without an "XLA Modules" thread, programs are the runs of events
    tagged with one ``args.hlo_module``. Also the whole step's ``span_s`` and average rates, with
    ``link_gb_s`` (54 GB/s per direction on the H200: gpu_facts.md) for reference.

    Returns ``{"phases": [...], "step": {...}}``; empty phases when the trace has no module events.
    """
    data = _load_trace(trace) if isinstance(trace, (str, os.PathLike)) else trace
    events = data.get("traceEvents", []) if isinstance(data, dict) else list(data)
    procs, threads = {}, {}
    for ev in events:
        if ev.get("ph") == "M" and ev.get("name") == "process_name":
            procs[ev.get("pid")] = str((ev.get("args") or {}).get("name", ""))
        if ev.get("ph") == "M" and ev.get("name") == "thread_name":
            threads[(ev.get("pid"), ev.get("tid"))] = str((ev.get("args") or {}).get("name", ""))
    gpu = {pid for pid, n in procs.items() if re.search(r"/device:GPU|\bGPU\b|cuda", n, re.I)}
    modules, copies, all_x, compute, tagged = [], [], [], [], []
    for ev in events:
        if ev.get("ph") != "X" or (gpu and ev.get("pid") not in gpu) or "dur" not in ev:
            continue
        t0, t1 = float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])
        all_x.append((t0, t1))
        tname = threads.get((ev.get("pid"), ev.get("tid")), "")
        if "XLA Modules" in tname:
            modules.append((t0, t1, str(ev.get("name", ""))))
            continue
        name = str(ev.get("name", ""))
        args = ev.get("args") or {}
        module = args.get("hlo_module") if isinstance(args, dict) else None
        if module:
            tagged.append((t0, t1, str(module)))
        is_copy = _MEMCPY_LIKE.search(name) or (isinstance(args, dict) and "memcpy_details" in args)
        if not is_copy:
            if "XLA Ops" in tname or module or not tname:
                compute.append((t0, t1))
            continue
        if _API_NAME.match(name):
            continue
        d, nb = _event_direction(ev), _event_bytes(ev)
        if d in ("h2d", "d2h") and nb is not None:
            copies.append((t0, t1, d, nb))
    if not modules and tagged:
        modules = _module_runs(tagged)
    modules.sort()

    def summary(name, t0, t1, cps):
        dur = max(t1 - t0, 1e-9)
        out = {"phase": name, "start_us": t0, "duration_s": dur / 1e6}
        bound = []
        for d in ("h2d", "d2h"):
            mine = [(max(a, t0), min(b, t1)) for a, b, dd, _ in cps if dd == d]
            nbytes = sum(nb for a, b, dd, nb in cps if dd == d)
            busy = _union_us([iv for iv in mine if iv[1] > iv[0]])
            out[f"{d}_bytes"] = int(nbytes)
            out[f"{d}_busy_s"] = busy / 1e6
            out[f"{d}_gb_s"] = nbytes / (dur / 1e6) / 1e9
            out[f"{d}_gb_s_while_busy"] = nbytes / (busy / 1e6) / 1e9 if busy else None
            if busy >= bound_fraction * dur:
                bound.append(d)
        # copies running while no kernel computes: time the program waited on PCIe
        copying = [(max(a, t0), min(b, t1)) for a, b, _, _ in cps if min(b, t1) > max(a, t0)]
        busy_any = _union_us(copying)
        inside = [(max(a, t0), min(b, t1)) for a, b in compute if min(b, t1) > max(a, t0)]
        overlap = _union_us(copying + inside) - _union_us(inside)  # copy time outside compute
        out["copy_busy_s"] = busy_any / 1e6
        out["copy_only_s"] = max(overlap, 0.0) / 1e6
        out["copy_only_fraction"] = out["copy_only_s"] / (dur / 1e6)
        if not bound and compute and out["copy_only_fraction"] >= exposed_fraction:
            bound.append("h2d" if out.get("h2d_bytes", 0) >= out.get("d2h_bytes", 0) else "d2h")
        out["transfer_bound"] = bound
        return out

    phases, taken = [], set()
    for t0, t1, name in modules:
        cps = [c for i, c in enumerate(copies) if i not in taken and t0 <= (c[0] + c[1]) / 2 <= t1]
        taken |= {i for i, c in enumerate(copies) if t0 <= (c[0] + c[1]) / 2 <= t1}
        phases.append(summary(name, t0, t1, cps))
    rest = [c for i, c in enumerate(copies) if i not in taken]
    if rest and modules:
        ph = summary("outside programs", min(c[0] for c in rest), max(c[1] for c in rest), rest)
        ph["transfer_bound"] = []  # not a phase of computation: nothing waits on it here
        phases.append(ph)
    step = {}
    if all_x:
        step = summary("step", min(a for a, _ in all_x), max(b for _, b in all_x), copies)
        step["link_gb_s"] = link_gb_s
    return {"phases": phases, "step": step}


# ---- NVML PCIe counters (an estimate) ------------------------------------------------------

#: nvmlFieldValue ids of the cumulative PCIe byte counters (nvml.h; NVML 12.x and later).
_FI_PCIE_TX_BYTES = 197
_FI_PCIE_RX_BYTES = 198


class NvmlPcieSampler:
    """Samples the GPU's PCIe traffic in a thread between :meth:`start` and :meth:`stop`.

    Two methods, the first that works:

    - ``field_counters``: ``nvmlDeviceGetFieldValues`` with ``NVML_FI_DEV_PCIE_COUNT_TX_BYTES`` /
      ``RX_BYTES`` (cumulative byte counters; polled every ``interval_s`` so a 32-bit counter's
      wrap is seen), difference end - start.
    - ``throughput_integral``: ``nvmlDeviceGetPcieThroughput`` TX / RX (KB/s over the driver's
      last 20 ms window, each call blocking ~20 ms), integrated over the wall time between
      samples with 1 KB = 1024 B.

    TX is what the GPU sends (device -> host), RX what it receives (host -> device). Both count
    everything on the link (protocol overhead, other processes on the GPU), so the result is an
    **estimate** (``"estimate": True``). Needs ``pynvml`` (nvidia-ml-py); without it, or without a
    GPU, :meth:`stop` returns ``{"available": False, "error": ...}``.
    """

    def __init__(self, device_index: int = 0, interval_s: float = 0.005):
        self.device_index = device_index
        self.interval_s = interval_s
        self._thread = None
        self._stop = threading.Event()
        self._result: dict = {}
        self._error = None

    def start(self) -> "NvmlPcieSampler":
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml = pynvml
            self._h = pynvml.nvmlDeviceGetHandleByIndex(self.device_index)
        except Exception as e:  # no pynvml, no driver, no GPU
            self._error = f"{type(e).__name__}: {e}"
            return self
        self._method = "field_counters" if self._fields() is not None else "throughput_integral"
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _fields(self):
        """(tx, rx, modulus) from the cumulative counters, or None where unsupported."""
        try:
            vals = self._nvml.nvmlDeviceGetFieldValues(self._h, [_FI_PCIE_TX_BYTES, _FI_PCIE_RX_BYTES])
            out = []
            for v in vals:
                if getattr(v, "nvmlReturn", 0) != 0:
                    return None
                vt = getattr(v, "valueType", 1)
                if vt in (2, 3):  # unsigned long, unsigned long long
                    out.append((int(v.value.ullVal), 2 ** 64))
                else:
                    out.append((int(v.value.uiVal), 2 ** 32))
            return out
        except Exception:
            return None

    def _run(self):
        tx_total = rx_total = 0
        n = 0
        t_start = time.perf_counter()
        if self._method == "field_counters":
            prev = self._fields()
            while True:
                stopping = self._stop.wait(self.interval_s)
                cur = self._fields()
                if cur is not None and prev is not None:
                    (tx, mod_t), (rx, mod_r) = cur
                    tx_total += (tx - prev[0][0]) % mod_t
                    rx_total += (rx - prev[1][0]) % mod_r
                    prev = cur
                    n += 1
                if stopping:
                    break
        else:
            tx_c = getattr(self._nvml, "NVML_PCIE_UTIL_TX_BYTES", 0)
            rx_c = getattr(self._nvml, "NVML_PCIE_UTIL_RX_BYTES", 1)
            t_prev = time.perf_counter()
            while True:
                try:
                    tx = self._nvml.nvmlDeviceGetPcieThroughput(self._h, tx_c)  # KB/s, blocks ~20 ms
                    rx = self._nvml.nvmlDeviceGetPcieThroughput(self._h, rx_c)
                except Exception as e:
                    self._error = f"{type(e).__name__}: {e}"
                    break
                t = time.perf_counter()
                tx_total += tx * 1024 * (t - t_prev)
                rx_total += rx * 1024 * (t - t_prev)
                t_prev = t
                n += 1
                if self._stop.is_set():
                    break
        self._result = {"d2h_bytes_estimate": int(tx_total), "h2d_bytes_estimate": int(rx_total),
                        "samples": n, "method": self._method, "wall_s": time.perf_counter() - t_start}

    def stop(self) -> dict:
        """Stop sampling; returns ``{"available", "estimate", "method", "h2d_bytes_estimate",
        "d2h_bytes_estimate", "samples", "wall_s"}`` or ``{"available": False, "error"}``."""
        if self._thread is None:
            return {"available": False, "estimate": True, "error": self._error or "not started"}
        self._stop.set()
        self._thread.join()
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass
        out = {"available": True, "estimate": True, **self._result}
        if self._error:
            out["error"] = self._error
        return out


# ---- profiling one call ----------------------------------------------------------------------


def _profiler_options():
    """ProfileOptions with the Python and host tracers off (the trace needs GPU activity only),
    or None where this jax has no such options."""
    import jax

    try:
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0
        opts.host_tracer_level = 0
        return opts
    except Exception:
        return None


def profile_transfer_bytes(fn: Callable[[], object], *, nvml: bool = True, log_dir: str | None = None,
                           max_samples: int = 5, keep_trace_to: str | None = None,
                           retry_default_options: bool = True) -> dict:
    """Run ``fn()`` (one training step that waits for itself) under ``jax.profiler.trace`` and
    count the GPU's host<->device copies from the trace; NVML PCIe counters sample alongside.

    The trace is taken with the Python and host tracers off (``ProfileOptions``); if a GPU is
    present and that trace holds no GPU events, ``fn`` runs once more under the profiler's
    default options (``retry_default_options``) and that second call is the one reported.

    Args:
      fn: called once per attempt; must ``block_until_ready`` its results so the copies fall in
        the trace.
      nvml: also run :class:`NvmlPcieSampler` during the call.
      log_dir: where the trace goes (default: a temporary folder, removed afterwards).
      max_samples: raw events kept (see :func:`parse_trace_transfers`).
      keep_trace_to: copy the trace file to this path (e.g. to bring it back from the GPU).
      retry_default_options: see above.

    Returns :func:`parse_trace_transfers`'s dict plus ``result`` (what the last ``fn`` call
    returned), ``trace_file``, ``profiler_error`` (str or None: the trace failed or could not be
    parsed), ``nvml`` (:meth:`NvmlPcieSampler.stop`'s dict for the reported call, or None),
    ``calls`` (how many times ``fn`` ran) and ``attempts`` (options, device events, error each).

    Raises:
      whatever ``fn`` raises.
    """
    import jax

    params = inspect.signature(jax.profiler.trace).parameters
    base_kw = {"create_perfetto_trace": True} if "create_perfetto_trace" in params else {}
    opts = _profiler_options() if "profiler_options" in params else None
    plans = [("tracers off", dict(base_kw, profiler_options=opts))] if opts is not None else []
    if not plans or retry_default_options:
        plans.append(("default", dict(base_kw)))
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    attempts, out = [], None
    for label, kw in plans:
        out = _trace_once(fn, kw, nvml, log_dir, max_samples, keep_trace_to)
        attempts.append({"options": label, "n_device_events": out["n_device_events"],
                         "profiler_error": out["profiler_error"]})
        if out["n_device_events"] > 0 or not on_gpu:
            break
    out["attempts"] = attempts
    out["calls"] = len(attempts)
    return out


def _trace_once(fn, kw, nvml, log_dir, max_samples, keep_trace_to) -> dict:
    import shutil

    import jax

    tmp = None
    if log_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench_trace_")
        log_dir = tmp.name
    sampler = NvmlPcieSampler().start() if nvml else None
    result, error, trace_file = None, None, None
    state = {"inside": False, "ran": False}
    parsed = parse_trace_transfers({"traceEvents": []}, max_samples)
    try:
        try:
            with jax.profiler.trace(log_dir, **kw):
                state["inside"] = True
                result = fn()
                state["ran"] = True
        except Exception as e:
            if state["inside"] and not state["ran"]:
                raise  # fn itself failed
            error = f"{type(e).__name__}: {e}"  # the profiler failed to start or to export
            if not state["ran"]:
                result = fn()
        trace_file = find_trace_file(log_dir)
        if trace_file is None:
            error = error or f"no trace file under {log_dir}"
        else:
            try:
                parsed = parse_trace_transfers(trace_file, max_samples)
                parsed["transfer_phases"] = transfer_phases(trace_file)
            except Exception as e:
                error = f"parse failed: {type(e).__name__}: {e}"
            if keep_trace_to:
                os.makedirs(os.path.dirname(os.path.abspath(keep_trace_to)), exist_ok=True)
                shutil.copyfile(trace_file, keep_trace_to)
    finally:
        nv = sampler.stop() if sampler is not None else None
        if tmp is not None:
            tmp.cleanup()
            trace_file = None if trace_file is None else f"(removed) {trace_file}"
    if keep_trace_to and trace_file is not None:
        trace_file = keep_trace_to
    return {**parsed, "result": result, "trace_file": trace_file, "profiler_error": error, "nvml": nv}
