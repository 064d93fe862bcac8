"""A small step-time model, calibrated by measured rates (shared/guides/gpu_facts.md).

The forward and the backward are each bound by whichever is slower of compute (training FLOPs
plus the per-stage recompute, at the matmul rate) and the chunk traffic of that phase (PCIe, one
direction at a time inside one program); every parameter updates where its chunk lives.
The pipelined step (:func:`predict_pipelined_step`) is timed on one timeline of its programs
(:func:`program_timeline`): the host thread's queue of hand-offs, the gradient window that holds
the next program back until the host catches up, and the streamed pipeline from each program's
end (issue 23).
The defaults are the H200 figures measured on the lent machine; pass measured values when known.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from chunkjax.flops import matmul_flops  # noqa: F401 (re-exported: counted in chunkjax.flops)
from chunkjax.host_contention import step_host_s_per_param


@dataclasses.dataclass(frozen=True)
class Rates:
    """Measured rates (units in the names).

    Attributes:
      matmul_flops_per_s: achieved training FLOP rate (plain JAX reached 336-367 TFLOP/s on the
        H200 with remat; the 8192^3 jnp.dot probe 587).
      h2d_bytes_per_s: host -> device over PCIe, one direction (53-55 GB/s).
      d2h_bytes_per_s: device -> host, one direction.
      one_program_duplex_bytes_per_s: both directions inside one jitted program (57 GB/s).
      duplex_bytes_per_s: both directions at once by eager transfers from two threads, the
        streamed pipeline's (:mod:`chunkjax.streamed`; 94 GB/s in total).
      device_update_s_per_param: AdamW with state resident on the device (0.0074 ns).
      host_update_s_per_param: in-place host AdamW on 16 cores (0.27 ns), alone.
      host_update_loaded_s_per_param: the same kernel beside the device's compute and both PCIe
        directions (:func:`chunkjax.host_contention.measure_loaded_host_update_rate`); where > 0
        the step's host thread is timed at it (:func:`chunkjax.host_contention.step_host_s_per_param`).
      host_memory_bytes_per_s: the host's memory bandwidth that the host kernel's traffic and the
        PCIe DMA share (the kernel reads and writes each host-updated param's master, moments and
        gradient; every transferred byte is read or written in host memory once): 110 GB/s, the four
        recorded drop-in updates on the lent H200 boxes (kernel + DMA bytes over the update's
        seconds: 106-120 GB/s at 12-16 kernel threads, ``docs/dropin.md``, "Host memory bandwidth").
        0: not modelled (the drop-in's lanes are then PCIe and kernel only).
      disk_read_bytes_per_s / disk_write_bytes_per_s: one storage device, each way (the lent
        H200's local disk: 1.4 GB/s each way, ``dd`` with O_DIRECT). The disk tier's reads and
        writes of one device are timed one after the other (they share it).
    """

    matmul_flops_per_s: float = 350e12
    h2d_bytes_per_s: float = 54e9
    d2h_bytes_per_s: float = 54e9
    one_program_duplex_bytes_per_s: float = 57e9
    duplex_bytes_per_s: float = 94e9
    device_update_s_per_param: float = 0.0074e-9
    host_update_s_per_param: float = 0.27e-9
    host_update_loaded_s_per_param: float = 0.0
    host_memory_bytes_per_s: float = 110e9
    disk_read_bytes_per_s: float = 1.4e9
    disk_write_bytes_per_s: float = 1.4e9

    @classmethod
    def calibrated(cls, matmul_probe_flops_per_s: float, host_update_s_per_param: float | None = None,
                   training_efficiency: float = 0.9, **kw) -> "Rates":
        """Rates from this machine's measurements: ``matmul_flops_per_s`` is the bf16 8192^3
        ``jnp.dot`` rate times ``training_efficiency`` (a training step with recompute reached
        0.9-0.96 of the probe on the H200: plain JAX GPT2_1B, 475 TFLOP/s counted plus 1/3
        recompute against a 660 TFLOP/s probe)."""
        out = dict(matmul_flops_per_s=matmul_probe_flops_per_s * training_efficiency, **kw)
        if host_update_s_per_param is not None:
            out["host_update_s_per_param"] = host_update_s_per_param
        return cls(**out)

    @classmethod
    def from_record(cls, record, system: str | None = None) -> "Rates":
        """The rates a GPU run measured while its work competed (not each alone), so that a
        prediction with them can be checked against that run's measured seconds:
        :func:`chunkjax.recorded.recorded_rates` (each PCIe direction while both ran and the
        host kernel inside a drop-in update; the host kernel inside a bench step), the other
        fields at their defaults or the run's calibration.

        Args:
          record: a results JSON (path, or the parsed dict) of ``experiments/gpu_checks/dropin.py``
            or ``experiments/bench.py``. system: its system (default: the first ``chunk_host*``
            with a timeline, else ``"chunkjax"``).

        Raises:
          ValueError: no such system, or nothing to read from it.
        """
        from chunkjax.recorded import recorded_rates
        return cls(**recorded_rates(record, system, {f.name for f in dataclasses.fields(cls)}))


@dataclasses.dataclass(frozen=True)
class PipelinedStepTime:
    """Predicted seconds of a pipelined step (:mod:`chunkjax.schedule`) and where they go.

    Attributes:
      forward_s: forward pass, max(compute, its fetches at one direction's rate).
      backward_s: fused head + backward with recompute, max(compute, fetches + gradient
        offloads at the one-program duplex rate).
      host_update_s: the whole in-place host update.
      host_update_exposed_s: the part of it that does not overlap the backward pass.
      device_update_s: update programs of device-resident chunks after the backward.
      streamed_update_s: the part of the streamed pipeline (:mod:`chunkjax.streamed`) that runs
        after the backward (at the same time as the host thread's exposed part).
      compute_s: forward + backward + recompute FLOPs at the matmul rate.
      transfer_s: all forward/backward transfers at their rates.
      storage_update_s: the disk tier's work per step (Smart-Infinity's near-storage update):
        every ``storage`` chunk's master params and optimizer state read and written at the disk
        rates, on the busiest storage device (the devices run in parallel).
      storage_exposed_s: the part of it after the backward's end that the next step waits for:
        until the last storage chunk's new params are back (:func:`disk_step_times`). The reads
        run ahead from the step's start (the forward, the backward, with micro-batches the whole
        accumulation) up to the staging bound, and the last writes and the commit run on into
        the next step's forward.
      storage_hidden_s: ``storage_update_s`` minus what is exposed (>= 0): the disk time behind
        the forward and backward (and the accumulation) of this step and the next.
      window_stall_s: seconds the device waits between programs for the host thread: the step
        dispatches a program only once the host has consumed the gradients of the hand-off
        ``window - 1`` before (:func:`program_timeline`); the backward ends this much after
        ``forward_s + backward_s``.
      window: the gradient window the step was timed with (programs whose host gradients may
        exist at once; 0: unbounded).
      activation_bytes: activations moved to pinned host memory in the forward and back in the
        backward (remat ``"offload"``, :mod:`chunkjax.remat`; each way, in ``transfer_s``).
      recompute_saved_s: recompute the kept activations remove from the backward (matmul rate).
      cross_step: timed with cross-step overlap (:mod:`chunkjax.cross_step`):
        ``host_update_exposed_s`` is then the wait of the next step's forward after the backward's
        end for the host tail (:func:`cross_step_wait`), which runs beside the device updates and
        the streamed tail, and a step is never shorter than the host thread's whole work.
      norm_wait: timed as a step whose host updates wait for the global norm (clipping fires,
        no speculation: :mod:`chunkjax.clip_plan`): the host thread's whole work starts at the
        backward's end, beside the streamed pipeline.
    """

    forward_s: float
    backward_s: float
    host_update_s: float
    host_update_exposed_s: float
    device_update_s: float
    streamed_update_s: float
    compute_s: float
    transfer_s: float
    storage_update_s: float = 0.0
    storage_exposed_s: float = 0.0
    storage_hidden_s: float = 0.0
    window_stall_s: float = 0.0
    window: int = 0
    cross_step: bool = False
    activation_bytes: int = 0
    recompute_saved_s: float = 0.0
    norm_wait: bool = False

    @property
    def step_s(self) -> float:
        """Forward + backward + the window's stalls + the device-resident updates + the longer of
        the host thread's exposed tail and the streamed pipeline's (they run at once: the host
        kernel on the CPU, the streamed chunks over PCIe and on the device); the disk tier's
        exposed part runs beside all of them after the backward (docs/storage.md, "The disk as a
        placement"). With ``cross_step`` the host tail runs beside the device updates too, and
        the step is at least ``host_update_s`` (the host thread is then the bottleneck)."""
        if self.cross_step:
            tail = max(self.device_update_s + self.streamed_update_s, self.host_update_exposed_s)
            return max(self.forward_s + self.backward_s + self.window_stall_s + max(tail, self.storage_exposed_s),
                       self.host_update_s)
        return (self.forward_s + self.backward_s + self.window_stall_s
                + max(self.device_update_s + max(self.host_update_exposed_s, self.streamed_update_s),
                      self.storage_exposed_s))

    def to_dict(self) -> dict:
        """JSON-ready, with ``step_s``; the ``storage_*`` fields only when there is a disk update."""
        d = dataclasses.asdict(self) | {"step_s": self.step_s}
        if not self.storage_update_s:
            for k in ("storage_update_s", "storage_exposed_s", "storage_hidden_s"):
                del d[k]
        if not self.activation_bytes and not self.recompute_saved_s:  # no remat: as recorded before it
            del d["activation_bytes"], d["recompute_saved_s"]
        return d


def _disk_device(ready: Sequence[float], carry: float, read_s: float, write_s: float, kernel_s: float,
                 staging_buffers: int) -> tuple[float, float]:
    """One storage device's step (:class:`chunkjax.storage.tier.DiskTier`'s pipeline in the
    near-storage worker): ``(params_in, disk_free)``, seconds from the step's start when the last
    chunk's new params are back and when its last write ends. The disk serves reads and writes
    one at a time in issue order, busy until ``carry`` with the previous step's writes. The
    first ``staging_buffers - 1`` reads are issued at the start; chunk ``i``'s kernel runs once
    its state is read, its gradient and scalars are there (``ready[i]``) and chunk ``i-1``'s
    kernel is done, then its write is issued; the read of chunk ``i + staging_buffers - 1`` is
    issued after chunk ``i``'s kernel once the write of chunk ``i - 1`` has freed its buffer."""
    n, ra = len(ready), max(1, int(staging_buffers) - 2)
    free = carry
    read_end: list[float] = [0.0] * n
    write_end: list[float] = [0.0] * n

    def serve(issue: float, dur: float) -> float:
        nonlocal free
        free = max(issue, free) + dur
        return free

    for j in range(min(n, ra + 1)):
        read_end[j] = serve(0.0, read_s)
    kernel = 0.0
    for i in range(n):
        kernel = max(read_end[i], ready[i], kernel) + kernel_s
        write_end[i] = serve(kernel, write_s)
        j = i + ra + 1
        if j < n:
            read_end[j] = serve(max(kernel, write_end[i - 1] if i else 0.0), read_s)
    return kernel, free


def disk_step_times(devices: Sequence[Sequence[float]], *, file_bytes: int, staging_buffers: int, kernel_s: float,
                    backward_end: float, other_tail_s: float = 0.0, rates: Rates = Rates(),
                    iterations: int = 50) -> tuple[float, float]:
    """The disk tier's steady-state step (docs/storage.md, "The disk as a placement of the one plan").

    Each storage device updates its chunks in the order their gradients come (:func:`_disk_device`):
    its reads start at the step's start (read-ahead into ``staging_buffers`` buffers), each chunk's
    kernel and write once its gradient and the step's scalars are there, and the next step
    starts once every device's last chunk's params are back; the writes still queued then run on
    into the next step's forward and delay its reads. Iterated to the steady state (the disk
    busy ``carry`` seconds into each step).

    Args:
      devices: per storage device, its chunks' ready times (seconds from the step's start: the
        backward's end, ``backward_end``, when the update waits for the global norm; the end of the
        program completing the gradient on the norm-free early path), in update order.
      file_bytes: bytes of one chunk file (master, m, v), read and written once a step.
      staging_buffers: staging buffers per device (>= 3).
      kernel_s: one chunk's AdamW kernel in the worker (seconds).
      backward_end: when the backward (with micro-batches: the accumulation) ends, seconds.
      other_tail_s: the rest of the step after the backward (device updates, host and streamed
        tails): the step ends at ``backward_end + max(other_tail_s, exposed)``.

    Returns:
      ``(busy_s, exposed_s)``: the busiest device's disk seconds per step and the seconds after
      ``backward_end`` until the last params are back (>= 0).
    """
    rd = file_bytes / rates.disk_read_bytes_per_s
    wr = file_bytes / rates.disk_write_bytes_per_s
    busy = max((len(r) * (rd + wr) for r in devices), default=0.0)
    carry = [0.0] * len(devices)
    exposed = 0.0
    for _ in range(max(1, iterations)):
        ends = [_disk_device(r, c, rd, wr, kernel_s, staging_buffers) for r, c in zip(devices, carry)]
        exposed = max([0.0] + [p - backward_end for p, _ in ends])
        step_end = backward_end + max(other_tail_s, exposed)
        new = [max(0.0, free - step_end) for _, free in ends]
        if all(abs(a - b) <= 1e-12 for a, b in zip(new, carry)):
            break
        carry = new
    return busy, exposed


def _moved(start: float, nbytes: float, rate: float, share: float, until: float) -> float:
    """When ``nbytes`` started at ``start`` have moved: at ``rate * share`` before ``until`` (the
    backward's end, its own transfers taking the rest of the link), at ``rate`` after."""
    if start >= until or share >= 1.0:
        return max(start, 0.0) + nbytes / rate
    slow = rate * share
    room = (until - start) * slow
    if slow > 0 and nbytes <= room:
        return start + nbytes / slow
    return until + (nbytes - room) / rate


def streamed_pipeline_end(chunks: Sequence[tuple[float, int, int]], *, params_per_chunk: int, depth: int,
                          boundaries: Sequence[float], backward_end: float, share: float,
                          rates: Rates = Rates()) -> float:
    """When the streamed pipeline (:class:`chunkjax.streamed.Pipeline`) finishes its last chunk.

    Each chunk ``(ready_s, up_bytes, down_bytes)``, in ready order: its fetch starts when it is
    ready, the previous fetch is done and a slot is free (the write-back ``depth`` chunks earlier
    done); its update program runs at the second program boundary after the fetch (before
    ``backward_end``: the update programs queue between the backward's programs, behind the one
    program the step keeps queued ahead, :class:`chunkjax.streamed.StepStream`), else at once;
    its write-back follows the update and the previous write-back. Both directions run at once,
    each at ``min(one direction's rate, duplex_bytes_per_s / 2)``, times ``share`` before
    ``backward_end``.

    Args:
      chunks: per streamed chunk (seconds from the step's start, bytes up, bytes down).
      params_per_chunk: parameters per chunk (the update program at the device's rate).
      depth: the pipeline's slots (>= 1).
      boundaries: program ends before the backward's end (seconds).
      backward_end: the backward's end (seconds).
      share: the fraction of each direction left to the pipeline during the backward (0-1).

    Returns:
      seconds from the step's start (0.0 without chunks).
    """
    up_rate = min(rates.h2d_bytes_per_s, rates.duplex_bytes_per_s / 2)
    down_rate = min(rates.d2h_bytes_per_s, rates.duplex_bytes_per_s / 2)
    bounds = sorted(b for b in boundaries if b < backward_end)
    upd_s = params_per_chunk * rates.device_update_s_per_param
    depth = max(1, int(depth))
    written: list[float] = []
    fetched = updated = 0.0
    for i, (ready, up, down) in enumerate(sorted(chunks)):
        start = max(ready, fetched, written[i - depth] if i >= depth else 0.0)
        fetched = _moved(start, up, up_rate, share, backward_end)
        # dispatched at the first program boundary after its fetch, it runs after the program the
        # main thread has queued by then: at the boundary after that one
        later = [b for b in bounds if b >= fetched][1:]
        at = fetched if fetched >= backward_end else (later[0] if later else backward_end)
        updated = max(at, updated) + upd_s
        written.append(_moved(max(updated, written[-1] if written else 0.0), down, down_rate, share, backward_end))
    return written[-1] if written else 0.0


#: Programs whose host-chunk gradients may exist at once unless a plan says otherwise: the one the
#: host thread consumes and the one the device produces (:meth:`chunkjax.updaters.HostWork.hand_over`).
GRAD_WINDOW_PROGRAMS = 2


@dataclasses.dataclass(frozen=True)
class ProgramTime:
    """One program of a pipelined step on the timeline (:func:`program_timeline`), seconds from
    the step's start.

    Attributes:
      dispatch_s: the main thread dispatches it.
      start_s: the device starts it (the previous program done).
      end_s: the device is done with it (its gradients are ready).
      host_end_s: the host thread is done with every hand-off up to this program's.
    """

    dispatch_s: float
    start_s: float
    end_s: float
    host_end_s: float


def program_timeline(device_end_s: Sequence[float], host_s: Sequence[float], *, window: int,
                     hold_one: Sequence[bool] = ()) -> list[ProgramTime]:
    """The step's programs on one timeline, as :meth:`chunkjax.ChunkedStep.begin` runs them.

    The device runs the programs in order; program ``k`` would end at ``device_end_s[k]`` if
    nothing held it back, and every second it waits to be dispatched moves it and the programs
    after it later. The host thread updates a program's host chunks (``host_s[k]`` seconds; 0:
    the program hands nothing over) once the program is done and the host has finished the
    hand-offs before it (one thread, in order). After handing program ``k``'s gradients over,
    the main thread waits until the host has finished the hand-off ``window - 1`` before it
    (:meth:`chunkjax.updaters.HostWork.hand_over`) and, where ``hold_one[k]`` (early streamed
    chunks were handed to the pipeline: :meth:`chunkjax.streamed.StepStream.on_program`), until
    program ``k - 1`` is done; then it dispatches program ``k + 1``.

    Args:
      device_end_s: per program, its end without waits (seconds from the step's start,
        non-decreasing: the forward and the backward's programs back to back).
      host_s: per program, host-thread seconds of its hand-off (same length).
      window: the gradient window (>= 1 programs; 0: unbounded, the main thread never waits
        for the host).
      hold_one: per program, whether the main thread keeps at most one program queued after it
        (default: never).

    Returns:
      one :class:`ProgramTime` per program.

    Raises:
      ValueError: ``device_end_s`` and ``host_s`` differ in length.
    """
    if len(device_end_s) != len(host_s):
        raise ValueError(f"device_end_s has {len(device_end_s)} programs and host_s {len(host_s)}: "
                         "give one entry per program")
    hold = list(hold_one) + [False] * (len(device_end_s) - len(hold_one))
    out: list[ProgramTime] = []
    dispatch = end = prev_end = host = delay = 0.0
    handoffs: list[float] = []
    for k, (nominal, work) in enumerate(zip(device_end_s, host_s)):
        start = max(dispatch, end)
        delay += max(0.0, dispatch - end)  # the device idle, waiting for this dispatch
        prev_end, end = end, nominal + delay
        if work:
            host = max(end, host) + work
            handoffs.append(host)
        out.append(ProgramTime(dispatch, start, end, host))
        nxt = dispatch
        if hold[k] and k:
            nxt = max(nxt, prev_end)
        if work and window and len(handoffs) >= window:
            nxt = max(nxt, handoffs[-window])
        dispatch = nxt
    return out


def cross_step_wait(tail_s: float, chunks: Sequence[tuple[float, float]], forward_s: float) -> float:
    """With cross-step overlap (:mod:`chunkjax.cross_step`): seconds after the backward's end
    until the next step's forward, started at the backward's end, is no longer held back by this
    step's host tail.

    The host thread has ``tail_s`` seconds of updates left when the backward ends. It takes the
    ready chunks in the next step's read order (:class:`chunkjax.host_work.HostWork`), so the
    chunks it leaves for the end are those read last: the tail is taken from ``chunks`` read
    latest first until it holds ``tail_s`` seconds (work beyond the chunks listed counts as read
    at the forward's start), then updated in read order. The forward waits before each program
    for the chunks it takes, and the next step's first gradient hand-over joins the whole tail.

    Args:
      tail_s: host seconds left at the backward's end (:func:`program_timeline`).
      chunks: per host chunk, (seconds of its update, fraction of the next forward done when the
        first program taking it starts, 0 to 1).
      forward_s: the forward's seconds.

    Returns:
      ``max(0, max_i(h_i - f_i * forward_s), tail_s - forward_s)``, ``h_i`` the host's seconds
      until tail chunk ``i`` (in read order) is final.
    """
    if tail_s <= 0:
        return 0.0
    left, tail = tail_s, []
    for sec, f in sorted(chunks, key=lambda x: -x[1]):
        if left <= 0:
            break
        tail.append((min(sec, left), f))
        left -= min(sec, left)
    if left > 0:
        tail.append((left, 0.0))
    h, wait = 0.0, tail_s - forward_s
    for sec, f in sorted(tail, key=lambda x: x[1]):
        h += sec
        wait = max(wait, h - f * forward_s)
    return max(0.0, wait)


def _program_index(ends: Sequence[float], frac: float) -> int:
    """The program whose end (a fraction of the backward) is the first at or after ``frac``."""
    for k, f in enumerate(ends):
        if f >= frac - 1e-12:
            return k
    return len(ends) - 1


def speculated_ready(host_ready: Sequence[tuple[float, int]], speculation_params: float | None
                     ) -> list[tuple[float, int, bool]]:
    """``host_ready`` (per program: fraction of the backward done when it ends, host-updated
    parameters) under a speculation bound of ``speculation_params`` parameters (None: unbounded):
    ``(fraction, parameters, speculated)`` in hand-over order (by fraction), the first
    ``speculation_params`` parameters speculated at their program's fraction, the rest (not
    speculated) at the backward's end (1.0), where the norm is known.

    Raises:
      ValueError: a negative bound.
    """
    if speculation_params is not None and speculation_params < 0:
        raise ValueError(f"speculation_params={speculation_params!r}: pass parameters >= 0, or None (unbounded)")
    left, out = float("inf") if speculation_params is None else float(speculation_params), []
    for frac, params in sorted(host_ready, key=lambda x: x[0]):
        n = int(min(params, left))
        left -= n
        out += [(frac, n, True)] * (n > 0) + [(1.0, params - n, False)] * (params > n)
    return out


def predict_pipelined_step(flops_per_step: float, *, fwd_h2d: int, bwd_h2d: int, bwd_d2h: int,
                           device_params: int, host_ready: Sequence[tuple[float, int]],
                           streamed: Sequence[tuple[float, int, int]] = (), params_per_chunk: int = 0,
                           program_ends: Sequence[float] = (), streamed_early: bool = False,
                           depth: int = 2, rates: Rates = Rates(), storage: Sequence[tuple[float, int]] = (),
                           disk_file_bytes: int = 0, storage_params_per_chunk: int = 0,
                           storage_early: bool = False, staging_buffers: int = 3,
                           window: int = GRAD_WINDOW_PROGRAMS, cross_step: bool = False,
                           host_reads: Sequence[tuple[float, int]] = (), act_bytes: int = 0,
                           saved_flops: float = 0.0, passes: int = 1, looped_fetch: bool = False,
                           norm_wait: bool = False, speculation_params: float | None = None,
                           backup_bytes_per_param: float = 0.0) -> PipelinedStepTime:
    """Predict a pipelined step on one timeline (:func:`program_timeline`): forward, backward
    (with per-stage recompute: the forward's FLOPs again) cut into programs, a host thread that
    updates each program's host chunks once that program has finished (in program order, one at
    a time), the gradient window that holds the next program back until the host has caught up,
    the streamed pipeline (:func:`streamed_pipeline_end`: from the end of the program that
    completes each chunk's gradient when ``streamed_early``, else from the backward's end, when
    the global norm is known) and the device's update programs after the backward
    (:attr:`PipelinedStepTime.step_s`).

    Program ``k`` ends ``program_ends[k]`` of the backward after the forward, later by the
    window's waits before it.

    Args:
      flops_per_step: training FLOPs (6N + 12LSh per token, times tokens); forward is 1/3.
      fwd_h2d / bwd_h2d: chunk fetch bytes in the forward / fused head + backward.
      bwd_d2h: gradient bytes offloaded during the backward.
      device_params: parameters updated on the device.
      host_ready: per program, (fraction of the backward done when it ends, host-updated
        parameters whose gradients it completes).
      streamed: per streamed chunk, (fraction of the backward done when the program completing
        its gradient ends, bytes up, bytes down).
      params_per_chunk: parameters per streamed chunk.
      program_ends: fraction of the backward done at each program's end (default: the
        fractions named in ``host_ready``, ``streamed``, ``storage`` and 1.0).
      streamed_early: streamed chunks start as their program ends (else after the backward).
      depth: the streamed pipeline's slots.
      storage: per ``storage`` chunk in update order, (fraction of the backward done when the
        program completing its gradient ends, its storage device).
      disk_file_bytes: bytes of one storage chunk's file (read and written once a step).
      storage_params_per_chunk: parameters per storage chunk (the worker's kernel at
        ``host_update_s_per_param`` times the devices: each worker has its share of the cores).
      storage_early: the storage chunks update as their gradients complete (norm-free); else
        once the norm is known (the backward's end).
      staging_buffers: staging buffers per storage device (the read-ahead bound).
      window: the step's gradient window (programs; 0: unbounded).
      cross_step: the next step overlaps this one's host tail (:func:`cross_step_wait`,
        :attr:`PipelinedStepTime.step_s`).
      host_reads: with ``cross_step``, per host chunk (fraction of the next forward done when the
        first program taking it starts, its parameters).
      act_bytes: activations offloaded (remat ``"offload"``): down in the forward, beside its fetches,
        and up in the backward, both at the one-program duplex rate.
      saved_flops: recompute FLOPs the kept activations remove from the backward.
      passes: the programs run this many times a step (micro-batches per pass, or in-program
        groups: :mod:`chunkjax.plan_micro`), each a ``1 / passes`` share of the forward and the
        backward; the host hand-offs come in the last pass's backward (the earlier passes'
        gradients are summed, :func:`chunkjax.accumulate.mean_gradients`), so the programs'
        timeline is the last pass's, and with ``cross_step`` the next step's first pass's forward
        is what overlaps the host tail (its first backward program joins the tail).
      looped_fetch: the programs loop over micro-batches inside their moments as a while loop
        (:class:`chunkjax.walker.Walk` without ``unroll``): the backward's fetches are timed
        after the loop's compute, not under it (``c_bwd + bwd_h2d / h2d``; measured on the H200,
        GPT3_6B b16 with 4 micro-batches: backward programs with 1.18 GB of fetches ran 130-136 ms
        against 100-106 ms with one micro-batch, docs/design.md). The forward's fetches (measured
        nearly hidden) and the gradients' D2H stay overlapped.
      norm_wait: the host updates wait for the global norm (the step's clipping fires and it does
        not speculate): every host chunk is handed over at the backward's end, none holds the
        backward back (:meth:`chunkjax.host_work.HostWork.hand_over` stops waiting once the
        speculation stalls).
      speculation_params / backup_bytes_per_param: without ``norm_wait``, the speculation's bound
        (SuperOffload's speculation-then-validation, :mod:`chunkjax.speculate`): at most this many
        host-updated parameters (whole chunks: :func:`chunkjax.clip_plan.speculation_bound`) update
        before the norm is known, in hand-over order; once it is full the host thread waits for the
        norm (:meth:`chunkjax.speculate.Speculation.update`) and the rest update from the backward's
        end. Each speculated parameter adds ``2 * backup_bytes_per_param`` bytes (read + write, a
        rollback backup; 0 for inversion) of host memory traffic at ``host_memory_bytes_per_s``.
        None (default): unbounded, every host chunk speculates (free of copies at 0 bytes: the
        planner's view).
    """
    r = rates
    c_fwd = flops_per_step / 3 / r.matmul_flops_per_s
    c_bwd = max(0.0, flops_per_step - saved_flops) / r.matmul_flops_per_s  # 2/3 backward + 1/3 recompute
    fwd_transfer = (fwd_h2d / r.h2d_bytes_per_s if not act_bytes
                    else (fwd_h2d + act_bytes) / r.one_program_duplex_bytes_per_s)
    fwd = max(c_fwd, fwd_transfer)
    bwd_transfer = (bwd_h2d + bwd_d2h + act_bytes) / r.one_program_duplex_bytes_per_s
    bwd = max(c_bwd + (bwd_h2d / r.h2d_bytes_per_s if looped_fetch else 0.0), bwd_transfer)
    p = max(1, int(passes))
    last_bwd = bwd / p  # the last pass's backward, after every other pass and the last forward
    ends = sorted(set(program_ends) | {f for f, _ in host_ready} | {f for f, _, _ in streamed}
                  | {f for f, _ in storage} | {1.0})
    host_s = [0.0] * len(ends)
    if norm_wait:  # the streamed chunks' update reads the norm too
        host_ready, streamed_early = ([(1.0, sum(p for _, p in host_ready))] if host_ready else []), False
    host_rate = step_host_s_per_param(r)  # the kernel beside the step's transfers and compute
    copy_s = 2 * backup_bytes_per_param / r.host_memory_bytes_per_s if r.host_memory_bytes_per_s > 0 else 0.0
    if not norm_wait and (speculation_params is not None or copy_s):
        host_ready = speculated_ready(host_ready, speculation_params)
    for frac, params, *spec in host_ready:  # a speculated share also copies its backup
        host_s[_program_index(ends, frac)] += params * (host_rate + (copy_s if spec and spec[0] else 0.0))
    first_streamed = min((_program_index(ends, f) for f, _, _ in streamed), default=len(ends))
    hold = [streamed_early and k >= first_streamed for k in range(len(ends))]
    times = program_timeline([fwd + bwd * (p - 1) / p + f * last_bwd for f in ends], host_s, window=window,
                             hold_one=hold)
    end = times[-1].end_s
    stall = max(0.0, end - (fwd + bwd))
    host = sum(host_s)
    t_host = max((t.host_end_s for t in times), default=0.0)
    exposed = max(0.0, t_host - end) if host else 0.0
    if cross_step and host:
        exposed = cross_step_wait(exposed, [(n * host_rate, f) for f, n in host_reads], fwd / p)
    share = max(0.0, 1.0 - bwd_transfer / bwd) if bwd > 0 else 1.0
    last = streamed_pipeline_end([(times[_program_index(ends, f)].end_s if streamed_early else end, up, down)
                                  for f, up, down in streamed],
                                 params_per_chunk=params_per_chunk, depth=depth,
                                 boundaries=[t.end_s for t in times], backward_end=end, share=share, rates=r)
    dev_upd = device_params * r.device_update_s_per_param
    streamed_s = max(0.0, last - end) if streamed else 0.0
    busy = disk_exposed = 0.0
    if storage:
        n_dev = max(d for _, d in storage) + 1
        ready: list[list[float]] = [[] for _ in range(n_dev)]
        for f, d in storage:
            ready[d].append(times[_program_index(ends, f)].end_s if storage_early else end)
        busy, disk_exposed = disk_step_times(
            ready, file_bytes=disk_file_bytes, staging_buffers=staging_buffers,
            kernel_s=storage_params_per_chunk * r.host_update_s_per_param * n_dev, backward_end=end,
            other_tail_s=dev_upd + max(exposed, streamed_s), rates=r)
    return PipelinedStepTime(fwd, bwd, host, exposed, dev_upd, streamed_s, c_fwd + c_bwd,
                             fwd_transfer + bwd_transfer, busy, disk_exposed,
                             max(0.0, busy - disk_exposed), stall, int(window), bool(cross_step and host),
                             int(act_bytes), min(saved_flops, flops_per_step) / r.matmul_flops_per_s,
                             bool(norm_wait and host))
