"""The one accounting: what a schedule costs per step, in device bytes, bytes moved and seconds.

Every policy of :func:`chunkjax.plan.plan_schedule` decides a :class:`~chunkjax.schedule.Schedule`
(placement, fetches per moment, update locations, programs) and gets its :class:`~chunkjax.schedule.Prediction`
from :func:`predict`, with the same rules for the model data on the device, the update phase, the bytes
moved each way, the host bytes and the step time (:func:`chunkjax.cost.predict_pipelined_step`).
Policies differ only in how the device bytes at each moment are bounded:

* :func:`tide_moment_bytes`: model data on the device + the memory tide (:mod:`chunkjax.tide`) +
  gradients waiting on the device for their update + chunk buffers held or in flight (the tide
  plan, the ``all_host`` and ``zero_offload`` baselines);
* :func:`fixed_rule_moment_bytes`: the stage-window bound the fixed rule is planned with (every
  saved stage input, chunk buffers of the prefetch window, open float32 gradient accumulators and
  the stage's temporaries), PatrickStar's section 4.2 rule in its first, coarse form.

ZeRO (Rajbhandari et al., SC 2020) is accounted per rank: :meth:`ChunkBytes.per_rank` gives one
rank's chunk bytes for planning; :mod:`chunkjax.predict_zero` one rank's bytes moved and held and
the collective bytes it sends.
Pure functions of shapes: nothing is allocated.
"""
from __future__ import annotations

import bisect

import dataclasses
from typing import Sequence

import numpy as np

from chunkjax.cost import GRAD_WINDOW_PROGRAMS, Rates, predict_pipelined_step
from chunkjax.cross_step import next_read_fractions
from chunkjax.host_memory import storage_host_bytes
from chunkjax.memory import DEVICE, PINNED_HOST
from chunkjax.schedule import (DEVICE_UPDATE, HOST_UPDATE, NO_UPDATE, STORAGE_UPDATE, STREAMED_UPDATE, Placement,
                               Prediction, Schedule)
from chunkjax.stages import first_readers
from chunkjax.tide import Tide
from chunkjax.trace import StageTrace

#: float32 bytes per element: master params, gradient accumulators, update temporaries
F32_BYTES = 4
#: Staging buffers (one chunk's master params and state each) per storage directory: the bound of
#: the near-storage worker's read-ahead (``StorageOptions.staging_buffers``: it reads this many
#: minus one chunks before the step's norm is known), host memory of the disk tier
STORAGE_STAGING_BUFFERS = 3


def disk_file_bytes(cb: "ChunkBytes") -> int:
    """Bytes of one storage chunk's file (:mod:`chunkjax.storage.files`): the float32 master
    params and the AdamW moments (3 sections, each padded to 4096 bytes for O_DIRECT)."""
    return 3 * (-(-int(cb.master) // 4096) * 4096)
#: Streamed chunks whose update is on the device at once in the step (:mod:`chunkjax.streamed`:
#: chunk k+1's fetch while chunk k writes back, both PCIe directions in flight).
STREAMED_PIPELINE_DEPTH = 2


def grad_window_bytes(done_moments: Sequence[int], program_starts: Sequence[int], grad_bytes: int,
                      window: int = GRAD_WINDOW_PROGRAMS) -> int:
    """Host-chunk gradient bytes that exist at once: the most over ``window`` consecutive
    programs of the gradients completed in them.

    Args:
      done_moments: per host-updated chunk, the moment its gradient completes.
      program_starts: the moment each program begins (starts with 0, increasing).
      grad_bytes: one chunk's gradient (bytes; compute dtype).
      window: consecutive programs counted together (>= 1).

    Returns:
      bytes (0 without host chunks).
    """
    starts = list(program_starts)
    per = [0] * len(starts)
    for t in done_moments:
        k = bisect.bisect_right(starts, t) - 1  # the last program starting at or before t
        if k < 0:
            raise ValueError(f"a gradient completes at moment {t}, before the first program ({starts[0]})")
        per[k] += grad_bytes
    w = max(1, min(window, len(per)))
    return int(max((sum(per[i:i + w]) for i in range(len(per) - w + 1)), default=0))


@dataclasses.dataclass(frozen=True)
class ChunkBytes:
    """Bytes of one chunk in each chunk list.

    Attributes:
      params: compute-dtype params of one chunk (bytes).
      grad: compute-dtype gradient (bytes).
      master: float32 master params (bytes).
      opt: optimizer state, all leaves of the chunk's optax state (bytes).
      frozen: ``(chunk, bytes)`` per frozen chunk (``ChunkLayout.chunk_trainable`` False): its
        params in their own dtype, its only bytes (no gradient, master params or state).
    """

    params: int
    grad: int
    master: int
    opt: int
    frozen: tuple[tuple[int, int], ...] = ()

    @property
    def state(self) -> int:
        """Master params + optimizer state (bytes)."""
        return self.master + self.opt

    def params_of(self, c: int) -> int:
        """Bytes of chunk ``c``'s params: a frozen chunk's own, else :attr:`params`."""
        return dict(self.frozen).get(c, self.params)

    @property
    def buffer(self) -> int:
        """Bytes of the largest params chunk: a fetched chunk buffer's bound."""
        return max([self.params] + [b for _, b in self.frozen])

    def model_bytes(self, n_chunks: int) -> int:
        """Model data of ``n_chunks`` chunks: params + master + state of the trainable ones, params
        of the frozen ones (bytes; padding included)."""
        return (n_chunks - len(self.frozen)) * (self.params + self.state) + sum(b for _, b in self.frozen)

    def per_rank(self, ranks: int, zero_stage: int) -> "ChunkBytes":
        """One rank's bytes of a chunk split over ``ranks`` (ZeRO ``zero_stage``), for planning a
        rank's device memory: master params, optimizer state and gradients are the rank's 1/N
        (rounded up); compute params are, at stage 3, the gathered full chunk plus the rank's
        shard (a conservative figure: a resident chunk holds only its shard between reads), at
        stages 1/2 the full chunk (what a fetched or resident chunk occupies while read).

        Raises:
          ValueError: ``ranks < 1`` or a stage other than 1/2/3.
        """
        if ranks < 1 or zero_stage not in (1, 2, 3):
            raise ValueError(f"need ranks >= 1 and zero_stage in 1/2/3, got {ranks}, {zero_stage}")
        def params_bytes(b):
            return b + shard_bytes(b, ranks) if zero_stage == 3 else b
        return ChunkBytes(params=params_bytes(self.params), grad=shard_bytes(self.grad, ranks),
                          master=shard_bytes(self.master, ranks), opt=shard_bytes(self.opt, ranks),
                          frozen=tuple((c, params_bytes(b)) for c, b in self.frozen))


def shard_bytes(b: int, ranks: int) -> int:
    """One rank's bytes of ``b`` bytes split over ``ranks`` (rounded up)."""
    return -(-int(b) // ranks)


def chunk_bytes(layout, compute_dtype, opt_state_bytes: int) -> ChunkBytes:
    """Bytes of one chunk of ``layout`` (a :class:`chunkjax.ChunkLayout`) per chunk list.

    Args:
      layout: its ``chunk_size`` (elements) is used.
      compute_dtype: dtype of compute params and gradients (bf16: 2 bytes per element).
      opt_state_bytes: bytes of one chunk's optimizer state
        (:func:`chunkjax.optim.state_bytes_per_chunk`).

    Frozen chunks (``layout.chunk_trainable`` False) count their params in their own dtype only
    (``ChunkBytes.frozen``).
    """
    cs = layout.chunk_size
    it = np.dtype(compute_dtype).itemsize
    frozen = tuple((c, cs * np.dtype(layout.chunk_dtypes[c]).itemsize)
                   for c, t in enumerate(layout.chunk_trainable) if not t)
    return ChunkBytes(params=cs * it, grad=cs * it, master=cs * F32_BYTES, opt=opt_state_bytes, frozen=frozen)


def grad_done_moments(traces: Sequence[StageTrace], tide: Tide) -> dict[int, int]:
    """Chunk id -> index of the moment its gradient is complete: the backward (or fused) moment
    of the first stage that reads it."""
    by_stage: dict[int, list[int]] = {}
    for c, s in first_readers([t.chunks for t in traces]).items():
        by_stage.setdefault(s, []).append(c)
    done = {}
    for i, m in enumerate(tide.moments):  # a stage's chunks, at its last backward moment
        if m.phase != "forward":
            for c in by_stage.get(m.stage, ()):
                done[c] = i
    return done


def device_model_bytes(cb: ChunkBytes, param_kinds, update_locations) -> int:
    """Model data on the device between steps: compute params of device-kind chunks plus master
    params and optimizer state of device-updated chunks (bytes)."""
    return (sum(cb.params_of(c) for c, k in enumerate(param_kinds) if k == DEVICE)
            + sum(cb.state for u in update_locations if u == DEVICE_UPDATE))


def waiting_grad_bytes(cb: ChunkBytes, update_locations, grad_done: dict[int, int], n_moments: int,
                       micro_batches: int = 1) -> list[int]:
    """Per moment, bytes of the gradients of device-updated chunks that are complete and wait on
    the device for the update program; with ``micro_batches`` > 1 also every device-updated
    chunk's float32 micro-batch sum (``cb.master`` each, alive through every micro-batch:
    :func:`chunkjax.accumulate.mean_gradients`)."""
    dev = [c for c, u in enumerate(update_locations) if u == DEVICE_UPDATE]
    sums = len(dev) * cb.master if micro_batches > 1 else 0
    return [sums + sum(cb.grad for c in dev if grad_done.get(c, n_moments) <= t) for t in range(n_moments)]


def held_buffers(fetch, evict) -> list[int]:
    """Per moment, fetched chunk copies on the device (fetched and not yet released)."""
    out, live = [], set()
    for f, e in zip(fetch, evict):
        live |= set(f)
        out.append(len(live))
        live -= set(e)
    return out


def tide_moment_bytes(tide: Tide, cb: ChunkBytes, param_kinds, update_locations, fetch, prefetch: int,
                      held: Sequence[int], grad_done: dict[int, int], master_fetch=(),
                      micro_batches: int = 1) -> list[int]:
    """Device bytes at each moment: model data on the device + the tide's non-model bytes +
    waiting gradients + (chunk buffers held + fetches in flight for the next ``prefetch``
    moments) x one chunk's compute params (+ :func:`master_fetch_extra`).

    Args:
      held: per moment, fetched chunk copies on the device (the eviction plan's cache, or
        :func:`held_buffers`).
      master_fetch: chunk ids fetched as float32 master params (:mod:`chunkjax.host_forms`).
      micro_batches: gradient accumulation (:func:`waiting_grad_bytes`: device float32 sums).
    """
    T = len(tide.moments)
    model = device_model_bytes(cb, param_kinds, update_locations)
    waiting = waiting_grad_bytes(cb, update_locations, grad_done, T, micro_batches)
    out = []
    for t, m in enumerate(tide.moments):
        inflight = sum(len(fetch[u]) for u in range(t + 1, min(T, t + 1 + prefetch)))
        out.append(model + m.non_model_bytes + waiting[t] + (held[t] + inflight) * cb.buffer)
    extra = master_fetch_extra(cb, fetch, prefetch, master_fetch)
    return [b + e for b, e in zip(out, extra)]


def master_fetch_extra(cb: ChunkBytes, fetch, prefetch: int, master_fetch) -> list[int]:
    """Per moment, device bytes a master-fetch chunk's float32 buffer adds above its
    compute-dtype copy (``cb.master - cb.params`` each) while it is in flight or being cast:
    the fetches for this moment and the next ``prefetch`` ones."""
    mf, T = set(master_fetch), len(fetch)
    if not mf:
        return [0] * T
    return [sum(cb.master - cb.params for u in range(t, min(T, t + 1 + prefetch)) for c in fetch[u] if c in mf)
            for t in range(T)]


def host_figures(chunk_size: int, cb: ChunkBytes, param_kinds, update_locations, done_moments: dict[int, int],
                 segments, n_moments: int, *, master_fetch=(), micro_batches: int = 1,
                 window: int = GRAD_WINDOW_PROGRAMS) -> dict:
    """The host-memory figures of a schedule's decisions (bytes; :class:`~chunkjax.schedule.Prediction`).

    ``host_model_bytes``: pinned compute params (none for a ``master_fetch`` chunk: its master
    params are in its state), master params and state of ``host``/``streamed`` chunks, every
    offloaded chunk's gradient. ``host_working_bytes``: the host-updated chunks' gradients that
    exist at once (:func:`grad_window_bytes` over ``segments``; with
    ``micro_batches`` > 1 every host and streamed chunk's float32 sum as well, the mean written
    over it: :func:`chunkjax.accumulate.mean_in_place`) and every streamed
    chunk's new compute params and state, written back beside the old until the step returns. ``host_bytes``: the
    model data plus that working set (streamed chunks' gradients whole). The per-parameter
    figures divide by all parameters (``host_bytes_per_param``) and by those of chunks whose
    state is in host memory (``host_resident_bytes_per_param``).

    Args:
      done_moments: chunk -> the moment its gradient completes (:func:`grad_done_moments`; a
        chunk no stage reads completes at the last of the ``n_moments``).
      window: the step's gradient window (programs; :func:`grad_window_bytes`).
    """
    mf, n = set(master_fetch), len(param_kinds)
    T = n_moments
    model = resident = 0
    host = []
    for c, (k, u) in enumerate(zip(param_kinds, update_locations)):
        params = cb.params_of(c) if k == PINNED_HOST and c not in mf else 0
        model += params
        if u in (HOST_UPDATE, STREAMED_UPDATE):
            model += cb.state + cb.grad
            resident += params + cb.state + (cb.grad if u == STREAMED_UPDATE else 0)
        if u == HOST_UPDATE:
            host.append(done_moments.get(c, T - 1))
    working = grad_window_bytes(host, segments, cb.grad, window) if host else 0
    if micro_batches > 1:  # float32 sums, the mean written over each (chunkjax.accumulate.mean_in_place)
        working += (len(host) + sum(u == STREAMED_UPDATE for u in update_locations)) * cb.master
    # a streamed chunk's new params and state come back into new pinned buffers while the step's
    # input state still holds the old ones (:class:`chunkjax.streamed.StepStream`): both exist
    # until the step returns (measured: the 8B full fine-tuning ran out of a pool sized without them)
    working += sum(u == STREAMED_UPDATE for u in update_locations) * (cb.params + cb.state)
    total = model - len(host) * cb.grad + working
    n_res = sum(u in (HOST_UPDATE, STREAMED_UPDATE) for u in update_locations)
    return {"host_model_bytes": int(model), "host_bytes": int(total), "host_working_bytes": int(working),
            "host_bytes_per_param": total / (n * chunk_size) if n and chunk_size else 0.0,
            "host_resident_bytes_per_param": (resident + working) / (n_res * chunk_size) if n_res else 0.0}


def fixed_rule_moment_bytes(chunk_size: int, traces: Sequence[StageTrace], cb: ChunkBytes, param_kinds,
                            update_locations, prefetch: int) -> list[int]:
    """Device bytes at each moment as the fixed rule bounds them, per stage: model data on the
    device + every saved stage input + chunk buffers of host-param chunks read within the prefetch
    window + float32 gradient accumulators open at the stage + gradients of device-updated chunks
    waiting for the update + the stage's temporaries. A stage's forward and backward moments share
    its figure (moments in tide order)."""
    n = len(param_kinds)
    model = device_model_bytes(cb, param_kinds, update_locations)
    saved = sum(t.input_bytes for t in traces[1:])
    # first (forward order) stage reading each chunk: its gradient is complete after that stage's
    # backward; last reader: its accumulator opens at that stage's backward
    first = {c: min(s for s, t in enumerate(traces) if c in t.chunks) for c in range(n)
             if any(c in t.chunks for t in traces)}
    last = {c: max(s for s, t in enumerate(traces) if c in t.chunks) for c in first}
    window = max(prefetch, 1)
    per_stage = []
    for s, t in enumerate(traces):
        near = {c for s2 in range(s, min(len(traces), s + window + 1)) for c in traces[s2].chunks}
        fetched = sum(cb.params_of(c) for c in near if param_kinds[c] == PINNED_HOST)
        acc = sum(chunk_size * F32_BYTES for c in first
                  if first[c] <= s <= last[c] and update_locations[c] != NO_UPDATE)
        waiting = sum(cb.grad for c in first if update_locations[c] == DEVICE_UPDATE and first[c] >= s)
        per_stage.append(model + saved + fetched + acc + waiting + t.temp_bytes)
    k = len(traces)
    return [per_stage[s] for s in list(range(k)) + list(range(k - 2, -1, -1))]


def streamed_pipeline_bytes(chunk_size: int, cb: ChunkBytes) -> int:
    """Device bytes of the step's streamed pipeline (:mod:`chunkjax.streamed`):
    :data:`STREAMED_PIPELINE_DEPTH` chunks' gradient, master params, state and new compute params,
    and one update's two float32 temporaries."""
    return STREAMED_PIPELINE_DEPTH * (cb.grad + cb.state + cb.params) + 2 * chunk_size * F32_BYTES


def update_phase_bytes(chunk_size: int, cb: ChunkBytes, update_locations) -> int:
    """Device bytes of the update phase above the resident model data: every device-updated
    chunk's gradient, waiting through the streamed pipeline (:func:`streamed_pipeline_bytes`,
    which runs first: :mod:`chunkjax.step_commit`), then one device update's two float32
    temporaries (measured: tests/test_live_device_bytes.py)."""
    dev_grads = sum(cb.grad for u in update_locations if u == DEVICE_UPDATE)
    device = 2 * chunk_size * F32_BYTES if DEVICE_UPDATE in update_locations else 0
    streamed = streamed_pipeline_bytes(chunk_size, cb) if STREAMED_UPDATE in update_locations else 0
    return dev_grads + max(device, streamed)


def fixed_rule_peak(chunk_size: int, traces: Sequence[StageTrace], cb: ChunkBytes, placement: Placement,
                    prefetch: int) -> int:
    """Peak device bytes of ``placement`` under the fixed rule: the largest of
    :func:`fixed_rule_moment_bytes` and the update phase (bytes)."""
    pk, loc = placement.param_kinds, placement.update_locations
    per = fixed_rule_moment_bytes(chunk_size, traces, cb, pk, loc, prefetch)
    return max(max(per), device_model_bytes(cb, pk, loc) + update_phase_bytes(chunk_size, cb, loc))


def update_working_bytes(chunk_size: int, cb: ChunkBytes) -> int:
    """Device bytes of one chunk's update outside the staged step (the drop-in optimizer): its
    float32 gradient and two float32 temporaries, master params and state, new compute params."""
    return 3 * chunk_size * F32_BYTES + cb.state + cb.params


def _program_ends(n_stages: int, n_moments: int, segments) -> list[tuple[int, int, float]]:
    """Per program: (first moment, end moment, fraction of the backward done when it ends)."""
    bounds = list(segments) + [n_moments]
    bwd_moments = n_moments - (n_stages - 1)
    return [(p0, p1, min(1.0, max(0.0, (p1 - (n_stages - 1)) / bwd_moments)))
            for p0, p1 in zip(bounds[:-1], bounds[1:])]


def _host_ready(chunk_size, traces, n_moments, update_locations, segments, grad_done):
    """Per program: (fraction of the backward done when it ends, host-updated params it completes)."""
    ends = _program_ends(len(traces), n_moments, segments)
    count = [0] * len(ends)
    for c, u in enumerate(update_locations):
        if u == HOST_UPDATE:
            k = _program_of(ends, grad_done.get(c, n_moments - 1))
            if k is not None:
                count[k] += 1
    return [(frac, n * chunk_size) for (_, _, frac), n in zip(ends, count) if n]


def _program_of(ends, moment: int) -> int | None:
    """The index of the program of :func:`_program_ends` ``ends`` whose moments hold ``moment``
    (None: none)."""
    k = bisect.bisect_right(ends, moment, key=lambda e: e[0]) - 1
    return k if k >= 0 and ends[k][0] <= moment < ends[k][1] else None


def _streamed_ready(cb: ChunkBytes, traces, n_moments, param_kinds, update_locations, segments, grad_done):
    """Per streamed chunk: (fraction of the backward done when the program completing its gradient
    ends, bytes up: gradient + master + state, bytes down: master + state + host-kind params),
    and the first moment after that program (the pipeline's bytes are on the device from there)."""
    ends = _program_ends(len(traces), n_moments, segments)
    found = []  # (program, chunk) in the programs' order, then the chunks'
    for c, u in enumerate(update_locations):
        if u == STREAMED_UPDATE:
            k = _program_of(ends, grad_done.get(c, n_moments - 1))
            if k is not None:
                found.append((k, c))
    found.sort()
    out = [(ends[k][2], cb.grad + cb.state, cb.state + (cb.params if param_kinds[c] == PINNED_HOST else 0))
           for k, c in found]
    return out, min((ends[k][1] for k, _ in found), default=n_moments)


def _storage_ready(traces, n_moments, update_locations, segments, grad_done, storage_devices: int):
    """Per storage chunk, in the order the backward completes their gradients (the workers'
    update order, :func:`chunkjax.storage.updater.gradient_order`): (fraction of the backward
    done when the program completing its gradient ends, its storage device: the k-th storage
    chunk in id order is on device ``k % storage_devices``)."""
    ids = [c for c, u in enumerate(update_locations) if u == STORAGE_UPDATE]
    dev = {c: k % max(1, storage_devices) for k, c in enumerate(ids)}
    frac = {}
    for p0, p1, f in _program_ends(len(traces), n_moments, segments):
        for c in ids:
            if p0 <= grad_done.get(c, n_moments - 1) < p1:
                frac[c] = f
    order = sorted(ids, key=lambda c: (grad_done.get(c, n_moments), c))
    return [(frac.get(c, 1.0), dev[c]) for c in order]


def streamed_early_extra(chunk_size: int, cb: ChunkBytes, traces, tide: Tide, param_kinds, update_locations,
                         segments, streamed_early: bool) -> list[int]:
    """Device bytes the streamed pipeline adds at each moment when streamed updates start early
    (from the end of the first program that completes a streamed chunk's gradient: the
    pipeline's buffers, :func:`streamed_pipeline_bytes`); zeros when they start after the backward."""
    T = len(tide.moments)
    streamed, first = _streamed_ready(cb, traces, T, param_kinds, update_locations, segments,
                                      grad_done_moments(traces, tide))
    early = streamed_pipeline_bytes(chunk_size, cb) if streamed_early and streamed else 0
    return [early if t >= first else 0 for t in range(T)]


def looped_fetch(traces: Sequence[StageTrace]) -> bool:
    """The moments loop over micro-batches inside their programs as a while loop (in-program
    traces, :func:`chunkjax.trace.in_program_traces`, not unrolled): the cost model's
    ``looped_fetch`` (:func:`chunkjax.cost.predict_pipelined_step`)."""
    return any(getattr(t, "micro_loop", 1) > 1 and not getattr(t, "loop_unrolled", False) for t in traces)


def predict(chunk_size: int, traces: Sequence[StageTrace], tide: Tide, cb: ChunkBytes, param_kinds,
            update_locations, fetch, segments, moment_bytes: Sequence[int], *, flops_per_step: float,
            rates: Rates = Rates(), forward_fetches: int | None = None, master_fetch=(),
            micro_batches: int = 1, streamed_early: bool = False, storage_devices: int = 1,
            storage_early: bool = False, staging_buffers: int = STORAGE_STAGING_BUFFERS,
            window: int = GRAD_WINDOW_PROGRAMS, cross_step: bool = False, prefetch: int = 1,
            storage_workers: int | None = None, norm_wait: bool = False, speculation_params: float | None = None,
            backup_bytes_per_param: float = 0.0) -> Prediction:
    """The :class:`~chunkjax.schedule.Prediction` of a schedule's decisions.

    Args:
      chunk_size: elements per chunk.
      traces, tide: the stage traces and their memory tide.
      cb: one chunk's bytes (one rank's under ZeRO).
      param_kinds, update_locations: per chunk, as in :class:`~chunkjax.schedule.Schedule`.
      fetch: per moment, chunk ids fetched for it.
      segments: program starts (moments).
      moment_bytes: device bytes at each moment (:func:`tide_moment_bytes` or
        :func:`fixed_rule_moment_bytes`).
      flops_per_step: training FLOPs of one step.
      rates: cost-model rates.
      forward_fetches: fetches timed in the forward pass (default: those of forward moments;
        a schedule that issues every fetch at the step's start passes all of them).
      master_fetch: host chunks fetched as their float32 master params (``cb.master`` bytes a
        fetch; no compute copy on the host: :mod:`chunkjax.host_forms`).
      micro_batches: gradient accumulation with every program run once per micro-batch
        (:func:`chunkjax.accumulate.mean_gradients`): the host working set holds float32 sums,
        and every fetch and offloaded gradient moves ``micro_batches`` times a step. A plan that
        loops over the micro-batches inside each moment passes 1 (groups: the passes) with the
        traces of :func:`chunkjax.trace.in_program_traces` (each chunk fetched once a pass; a
        loop not unrolled times the backward's fetches after it: :func:`looped_fetch`). The
        timeline is the last pass's (``passes`` of :func:`chunkjax.cost.predict_pipelined_step`).
      streamed_early: the step's streamed updates start as the program completing their
        gradient ends (:func:`chunkjax.streamed.starts_early`); their pipeline's bytes
        (:func:`streamed_pipeline_bytes`) are then on the device from that program's end. False:
        they start after the backward, when the global norm is known.
      storage_devices: storage devices (distinct filesystems) of the disk tier the ``storage``
        chunks are spread over: their disk links are timed apart.
      storage_workers: near-storage worker processes, one per storage directory (what
        :class:`chunkjax.storage.near.NearStorageOptimizer` starts; two directories on one
        filesystem are two workers): each holds ``staging_buffers`` files in host memory
        (``storage_host_bytes``) and its process (``storage_workers``). Default ``storage_devices``.
      storage_early: the storage chunks update as their gradients complete (the update does not
        read the global norm, one micro-batch: :func:`chunkjax.storage.updater.updates_early`);
        else once the norm is known.
      staging_buffers: staging buffers per storage device (the workers' read-ahead bound), counted
        in the host bytes (the rest of each worker with the process:
        :func:`chunkjax.host_memory.storage_process_bytes`).
      window: the step's gradient window (``Schedule.grad_window``): programs whose host
        gradients may exist at once (the host working set) and the stall it causes
        (:func:`chunkjax.cost.program_timeline`).
      cross_step, prefetch: the step runs with cross-step overlap (:mod:`chunkjax.cross_step`):
        its host tail is timed against the next forward's reads
        (:func:`chunkjax.cross_step.next_read_fractions` with the fetch distance ``prefetch``).
      norm_wait: time the step whose clipping fires (:mod:`chunkjax.clip_plan`): the host
        updates start at the backward's end and every host gradient of the step exists at once.
      speculation_params, backup_bytes_per_param: the speculation's bound (parameters; None:
        unbounded) and backup bytes per parameter, :func:`chunkjax.cost.predict_pipelined_step`.

    Kept activations (remat, the traces of :func:`chunkjax.remat.with_remat`): their device bytes
    are in the traces (the tide), their offloads (``StageTrace.offload_bytes``) move down in the
    forward and up in the backward and are all in pinned host memory at the forward's end (in
    ``host_working_bytes``), and ``StageTrace.saved_flops`` leave the backward's recompute.

    Bytes moved per step: every fetch brings one chunk's compute params up; every chunk not
    updated on the device sends its gradient down during the backward (both once per pass of the
    programs: ``micro_batches`` passes); a host-updated chunk whose
    params live on the device gets its new params back up; a streamed chunk moves its gradient and
    state up and its state (and host-kind params) down; a device-updated chunk whose params live on
    the host sends the new params down.
    """
    T = len(tide.moments)
    n_stages = len(traces)
    model = device_model_bytes(cb, param_kinds, update_locations)
    grad_done = grad_done_moments(traces, tide)
    streamed, _ = _streamed_ready(cb, traces, T, param_kinds, update_locations, segments, grad_done)
    moment_bytes = [b + e for b, e in zip(moment_bytes, streamed_early_extra(
        chunk_size, cb, traces, tide, param_kinds, update_locations, segments, streamed_early))]
    peak = max(max(moment_bytes, default=0), model + update_phase_bytes(chunk_size, cb, update_locations))
    n_fetch = sum(len(f) for f in fetch)
    mf = set(master_fetch)
    fetched = lambda c: cb.master if c in mf else cb.params_of(c)  # noqa: E731
    passes = micro_batches  # the programs' passes per step: fetches and offloaded gradients repeat
    fetch_b = passes * sum(fetched(c) for f in fetch for c in f)
    off = [c for c, u in enumerate(update_locations) if u in (HOST_UPDATE, STREAMED_UPDATE, STORAGE_UPDATE)]
    act = passes * sum(t.offload_bytes for t in traces)  # activations offloaded, each way
    h2d, d2h = fetch_b + act, passes * len(off) * cb.grad + act
    for c, (k, u) in enumerate(zip(param_kinds, update_locations)):
        if u == HOST_UPDATE:
            h2d += cb.params if k == DEVICE else 0
        elif u == STREAMED_UPDATE:
            h2d, d2h = h2d + cb.grad + cb.state, d2h + cb.state + (cb.params if k == PINNED_HOST else 0)
        elif u == DEVICE_UPDATE and k == PINNED_HOST:
            d2h += cb.params
    hf = host_figures(chunk_size, cb, param_kinds, update_locations, grad_done, segments, T, master_fetch=mf,
                      micro_batches=micro_batches, window=len(segments) if norm_wait else window)
    held_act = sum(t.offload_bytes for t in traces)  # offloaded activations, all in host memory at the forward's end
    if held_act:
        hf["host_working_bytes"] += held_act
        hf["host_bytes"] += held_act
        hf["host_bytes_per_param"] = hf["host_bytes"] / (len(param_kinds) * chunk_size)
    n_disk = sum(u == STORAGE_UPDATE for u in update_locations)
    workers = storage_devices if storage_workers is None else storage_workers
    staging = storage_host_bytes(disk_file_bytes(cb), workers, staging_buffers) if n_disk else 0
    if n_disk:  # storage chunks: gradients whole until the disk update, the workers' staging buffers
        hf["host_model_bytes"] += n_disk * cb.grad + staging
        hf["host_bytes"] += n_disk * cb.grad + staging
    if n_disk and micro_batches > 1:  # and their float32 sums (the mean written over each)
        hf["host_working_bytes"] += n_disk * cb.master
        hf["host_bytes"] += n_disk * cb.master
    if n_disk:
        hf["host_bytes_per_param"] = hf["host_bytes"] / (len(param_kinds) * chunk_size)
    fwd_b = passes * (sum(fetched(c) for t in range(n_stages - 1) for c in fetch[t]) if forward_fetches is None
                      else fetch_b // passes if forward_fetches >= n_fetch else forward_fetches * cb.params)
    time = predict_pipelined_step(
        flops_per_step, fwd_h2d=fwd_b, bwd_h2d=fetch_b - fwd_b, bwd_d2h=passes * len(off) * cb.grad,
        device_params=sum(u == DEVICE_UPDATE for u in update_locations) * chunk_size,
        host_ready=_host_ready(chunk_size, traces, T, update_locations, segments, grad_done),
        streamed=streamed, params_per_chunk=chunk_size, streamed_early=streamed_early,
        program_ends=[f for _, _, f in _program_ends(n_stages, T, segments)], depth=STREAMED_PIPELINE_DEPTH,
        rates=rates, storage=_storage_ready(traces, T, update_locations, segments, grad_done, storage_devices),
        disk_file_bytes=disk_file_bytes(cb), storage_params_per_chunk=chunk_size,
        storage_early=storage_early and micro_batches == 1, staging_buffers=staging_buffers, window=window,
        cross_step=cross_step, host_reads=[(f, chunk_size) for c, f in next_read_fractions(
            fetch, segments, prefetch, n_stages).items() if update_locations[c] == HOST_UPDATE] if cross_step else (),
        act_bytes=act, saved_flops=passes * sum(t.saved_flops for t in traces),
        passes=passes, looped_fetch=looped_fetch(traces), norm_wait=norm_wait,
        speculation_params=speculation_params, backup_bytes_per_param=backup_bytes_per_param)
    return Prediction(int(peak), int(model), hf.pop("host_model_bytes"), int(h2d), int(d2h), int(fetch_b),
                      int(passes * n_fetch), tuple(int(b) for b in moment_bytes), time, **hf,
                      disk_bytes_per_step=2 * n_disk * disk_file_bytes(cb), storage_chunks=n_disk,
                      storage_host_bytes=staging, storage_workers=workers if n_disk else 0)


def predict_optimizer_only(chunk_size: int, cb: ChunkBytes, update_locations, *, flops_per_step: float = 0.0,
                           rates: Rates = Rates()) -> Prediction:
    """The prediction of the drop-in optimizer's placement (params and gradients on the device,
    held by the training loop and not counted; master params and optimizer state of
    ``"device"`` chunks on the device, of ``"streamed"`` chunks in pinned host memory, moved up and
    back for each update). Peak = resident state + :func:`update_working_bytes`; no moments."""
    n_dev = sum(u == DEVICE_UPDATE for u in update_locations)
    n_str = sum(u == STREAMED_UPDATE for u in update_locations)
    model = n_dev * cb.state
    moved = n_str * cb.state
    time = predict_pipelined_step(flops_per_step, fwd_h2d=0, bwd_h2d=0, bwd_d2h=0, device_params=n_dev * chunk_size,
                                  host_ready=[], streamed=[(1.0, cb.state, cb.state)] * n_str,
                                  params_per_chunk=chunk_size, rates=rates)
    n = len(update_locations)
    return Prediction(int(model + update_working_bytes(chunk_size, cb)), int(model), int(moved), int(moved),
                      int(moved), 0, 0, (), time, host_bytes=int(moved),
                      host_bytes_per_param=moved / (n * chunk_size) if n else 0.0,
                      host_resident_bytes_per_param=moved / (n_str * chunk_size) if n_str else 0.0)


def device_bytes_by_kind(s: Schedule, traces: Sequence[StageTrace], tide: Tide, cb: ChunkBytes) -> dict[str, list[int]]:
    """Split a schedule's predicted device bytes per moment by kind (for plots).

    Returns lists (one entry per moment, bytes) keyed ``resident model data`` (model data placed
    on the device between steps), ``non-model (tide)``, ``gradients held`` (gradients of chunks
    whose compute params stay on the device, waiting for the update) and ``fetched chunk
    buffers`` (the rest: fetched copies and fetches in flight).
    """
    done = grad_done_moments(traces, tide)
    kept = [c for c in range(s.n_chunks) if s.param_kinds[c] == DEVICE and s.update_locations[c] != NO_UPDATE]
    model = s.predicted.device_model_bytes
    out = {"resident model data": [], "non-model (tide)": [], "gradients held": [], "fetched chunk buffers": []}
    for t, (m, total) in enumerate(zip(tide.moments, s.predicted.device_bytes_per_moment)):
        held = sum(cb.grad for c in kept if done.get(c, len(tide.moments)) <= t)
        for k, v in zip(out, (model, m.non_model_bytes, held, total - model - m.non_model_bytes - held)):
            out[k].append(int(v))
    return out

