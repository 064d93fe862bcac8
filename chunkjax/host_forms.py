"""The two forms of a host-updated chunk, and the host bytes each costs (issue 24, item 1).

A chunk updated in place on the host (update location ``host``) keeps its float32 master params
and optimizer state in host memory (12 bytes per parameter for AdamW). Its compute params come
in one of two forms:

* **copy**: a compute-dtype copy in pinned host memory (2 bytes per parameter for bf16), written
  by the host kernel as it updates the master params; a fetch moves that copy (2 bytes per
  parameter up);
* **master-fetch**: no copy. The float32 master params live in pinned host memory themselves
  (a ``jax.Array`` the kernel updates in place through a writable view); a fetch moves them
  (4 bytes per parameter up) and the device casts them to the compute dtype, round to nearest
  even: bit for bit the copy the kernel would have written.

Gradients of host chunks are not model data kept between steps: each leaves its program into
pinned host memory and is dropped as soon as the host kernel consumed it, and the step holds the
next program back until the host thread is done with the one
:data:`chunkjax.predict.GRAD_WINDOW_PROGRAMS` - 1
before (:meth:`chunkjax.updaters.HostWork.hand_over`), so at most the host gradients of that many
consecutive programs exist at once (:func:`chunkjax.predict.grad_window_bytes`). Speculated chunks' gradients
are held until the norm is known, within the speculation pool's bound (:mod:`chunkjax.speculate`).

PatrickStar (arXiv 2108.05818, section 4.3) keeps no fp16 param copy of an offloaded chunk either:
it reuses the fp16 param slot for the gradient; here the slot is dropped instead.
"""
from __future__ import annotations

import dataclasses

from chunkjax import predict as pr
from chunkjax.memory import PINNED_HOST
from chunkjax.schedule import HOST_UPDATE

#: Programs a step re-cut for its host gradients may have (:func:`chunkjax.plan.auto_segments`' bound).
MAX_PROGRAMS = 8
#: Finer cuts tried last, when even every host chunk master-fetch does not fit the host budget at
#: :data:`MAX_PROGRAMS` programs: each more program is one more launch and hand-over, and the
#: working set of :data:`chunkjax.predict.GRAD_WINDOW_PROGRAMS` programs shrinks with the cut
#: (GPT3_15B at batch 8 on the H200: 60 of its 176 host chunks' gradients, 6.35 GB, at 8
#: programs; about 2.7 GB at 16).
FINER_PROGRAMS = (16, 32)


def host_balanced_segments(n_moments: int, n_stages: int, done_moments, max_programs: int = MAX_PROGRAMS):
    """Program starts that spread the host chunks' gradients evenly over the backward programs,
    so that :data:`chunkjax.predict.GRAD_WINDOW_PROGRAMS` consecutive programs hold as few of
    them as the program count allows: the forward and the head one program, the backward cut at
    the quantiles of the moments where host gradients complete, and once more after the last of
    them (the rest, device chunks only, runs while the host thread finishes).

    Args:
      n_moments, n_stages: the step's moments and stages.
      done_moments: per host-updated chunk, the moment its gradient completes.
      max_programs: programs at most (>= 2).

    Returns:
      program starts (0 first, increasing), or None without host gradients in the backward.
    """
    first = n_stages  # moments 0..n-2 forward, n-1 the head, n.. backward
    d = sorted(t for t in done_moments if first <= t < n_moments)
    if not d:
        return None
    rest = d[-1] + 1 < n_moments
    parts = max(1, max_programs - 1 - rest)
    starts = {0, first} | {d[i * len(d) // parts] for i in range(1, parts)} | ({d[-1] + 1} if rest else set())
    return tuple(sorted(starts))


def assign_host_forms(s, cb, host_budget_bytes: int | None, *, chunk_size: int, traces, tide, rates,
                      flops_per_step: float, micro_batches: int = 1, host_bytes_of=None, predict=pr.predict):
    """Choose the form of each host-updated chunk of schedule ``s`` (one device), after its update
    locations: a compute-dtype copy while the host budget allows, master-fetch for the rest.

    With no budget, or one that holds every copy, every host chunk keeps its copy (the faster
    fetch). Otherwise the step is first re-cut (:func:`host_balanced_segments`) when that holds
    fewer host gradients at once, and if the copies still do not fit, the copies that fit beside the all-master-fetch need stay, for the chunks
    fetched most often (each copy saves ``cb.master - cb.params`` bytes up per fetch; ties by
    chunk id), the others are master-fetch. When even all master-fetch does not fit the host,
    finer cuts (:data:`FINER_PROGRAMS` programs at most) are tried for it, and the fewest
    programs that fit are kept; when none fits, the all-master-fetch schedule with the least
    working set is returned (its ``host_bytes`` is the least any form needs:
    the caller's host check refuses it naming that figure); when the float32 fetch buffers of
    all master-fetch do not fit the device budget, the copies are (the host check decides).

    Args:
      s: a :class:`~chunkjax.schedule.Schedule` (one rank, one device).
      cb: one chunk's bytes (:class:`chunkjax.predict.ChunkBytes`).
      host_budget_bytes: host memory for model data and the working set (bytes), or None.
      chunk_size, traces, tide, rates, flops_per_step: as :func:`chunkjax.predict.predict`.
      micro_batches: gradient accumulation (float32 sums join the working set).
      host_bytes_of: ``schedule -> bytes`` compared with the budget (default
        ``predicted.host_bytes``; the planner's measure: the GPU's pinned pool as it grows).
      predict: :func:`chunkjax.predict.predict` or the plan's memo of it (timed as the plan times
        its step: cross-step, the clipping expected).

    Returns:
      the schedule with ``master_fetch`` set and its prediction redone (H2D bytes and step time
      with 4-byte fetches, the device bytes of float32 fetch buffers, ``host_bytes``); never
      past ``s.budget_bytes`` on the device when ``s`` was not.
    """
    host = [c for c, (k, u) in enumerate(zip(s.param_kinds, s.update_locations))
            if u == HOST_UPDATE and k == PINNED_HOST]
    early = pr.streamed_early_extra(chunk_size, cb, traces, tide, s.param_kinds, s.update_locations, s.segments,
                                    s.streamed_early)  # predict adds it back (for the segments it is given)
    device_part = [b - e - x for b, e, x in zip(s.predicted.device_bytes_per_moment,
                                                pr.master_fetch_extra(cb, s.fetch, s.prefetch, s.master_fetch), early)]

    def with_forms(mf, segments):
        moments = [b + e for b, e in zip(device_part, pr.master_fetch_extra(cb, s.fetch, s.prefetch, mf))]
        pred = predict(chunk_size, traces, tide, cb, s.param_kinds, s.update_locations, s.fetch, segments,
                       moments, flops_per_step=flops_per_step, rates=rates, master_fetch=mf,
                       micro_batches=micro_batches, streamed_early=s.streamed_early)
        return dataclasses.replace(s, master_fetch=tuple(sorted(mf)), segments=tuple(segments), predicted=pred)

    hb = host_bytes_of or (lambda x: x.predicted.host_bytes)

    def fits(x):
        return hb(x) <= host_budget_bytes

    copies = with_forms((), s.segments) if (s.master_fetch or micro_batches > 1) else s
    if not host or host_budget_bytes is None or fits(copies):
        return copies
    done = pr.grad_done_moments(traces, tide)
    segs = host_balanced_segments(len(tide.moments), len(traces), [done[c] for c in host if c in done]) or s.segments
    if segs != tuple(s.segments):  # first the cheaper cure: fewer host gradients at once
        cut = with_forms((), segs)
        if cut.predicted.host_working_bytes < copies.predicted.host_working_bytes:
            copies = cut
            if fits(copies):
                return copies
    segs = copies.segments
    fetches = {c: 0 for c in host}
    for f in s.fetch:
        for c in f:
            if c in fetches:
                fetches[c] += 1
    least = with_forms(host, segs)
    if least.predicted.peak_device_bytes <= s.budget_bytes and not fits(least):
        # the last cure: a finer cut holds fewer host gradients at once (the fewest programs that fit)
        for n in FINER_PROGRAMS:
            fine = host_balanced_segments(len(tide.moments), len(traces), [done[c] for c in host if c in done],
                                          max_programs=n)
            if fine is None or fine == tuple(least.segments):
                continue
            finer = with_forms(host, fine)
            if finer.predicted.host_working_bytes < least.predicted.host_working_bytes:
                least = finer
                if fits(least):
                    break
        segs = least.segments
    if least.predicted.peak_device_bytes > s.budget_bytes or not fits(least):
        # float32 fetch buffers do not fit the device: the copies (the host check refuses them)
        return copies if least.predicted.peak_device_bytes > s.budget_bytes else least
    # each copy kept adds cb.params to predicted.host_bytes; under the planner's measure (a pool that
    # grows by doubling) it may add more: fewer copies until the measure fits
    order = sorted(host, key=lambda c: (-fetches[c], c))
    keep = min(len(host), (host_budget_bytes - hb(least)) // cb.params if cb.params else 0)
    while keep > 0:
        out = with_forms([c for c in host if c not in set(order[:keep])], segs)  # fewer float32 buffers
        if fits(out):
            return out
        keep = keep * 3 // 4
    return least
