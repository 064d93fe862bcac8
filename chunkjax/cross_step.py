"""Cross-step overlap: the previous step's host updates run on while the next step's forward
starts, and each program waits only for the host chunks it reads.

Without it a :class:`chunkjax.ChunkedStep` call starts by joining all of the previous step's
host work (:meth:`chunkjax.host_work.HostWork.join`): the host AdamW of the chunks whose
gradients came last (the first layers', whose backward ends the step) is exposed between the
steps. With ``cross_step=True`` (the default) the call instead

1. before dispatching program ``k``, waits until the host chunks program ``k`` takes
   (:meth:`chunkjax.ChunkedStep.program`: the chunks it fetches and reads) are final in the
   previous step's work (:meth:`~chunkjax.host_work.HostWork.wait_chunks`: updated with the
   right factor, or validated when speculated: :mod:`chunkjax.speculate`), so no program reads
   a stale or half-written chunk;
2. joins the whole previous work before handing any gradient of its own on (the first
   backward program): the previous step's errors surface here, before this step's own host,
   streamed or storage update starts and before its commit (:mod:`chunkjax.step_commit`), two
   steps' host work never run at once, a host chunk's update of this step always follows the
   previous one, and the previous speculation's outcome is known to this step's policy
   (:attr:`chunkjax.speculate.Speculation.speculating` is read at the first update);
3. has its own host work (and so the next step's view of it) update the ready chunks in the
   next step's read order (:func:`host_need`; :class:`chunkjax.host_work.HostWork`), so the
   chunks left when the backward ends are those the next forward reads last.

What still joins everything: :meth:`chunkjax.ChunkedStep.wait`, ``master_params``,
``eval_loss`` and checkpoints; a step with storage chunks joins the previous step at its start
(its workers write the next params in place: :mod:`chunkjax.storage.updater`). No deadlock: the
main thread waits only on the previous step's thread, whose work waits only for gradients and a
norm the previous step has already dispatched; this step's thread gets its first update after the
previous one is joined. The cost model's view: :func:`chunkjax.cost.cross_step_wait`, with the
next forward's reads from a schedule (:func:`next_read_fractions`).

PatrickStar (arXiv 2108.05818) section 5 (CPU updates overlapped with GPU work); SuperOffload
(ASPLOS'26), speculation-then-validation (a speculated chunk counts as final once validated).
"""
from __future__ import annotations

import bisect

import contextlib


def start(step, state, batch, cross: bool):
    """The start of a :meth:`chunkjax.ChunkedStep.begin`: ``(state, work, previous)``, the step's
    new :class:`~chunkjax.host_work.HostWork` (its ``need`` from :func:`host_need` with
    cross-step overlap) and the previous step's :class:`~chunkjax.speculate.Speculation` (the
    policy's input, read at the first update; after a restore the checkpoint's
    :class:`~chunkjax.speculate.Resumed` outcome). Without cross-step overlap (``cross`` False: the
    step's ``cross_step=False``, or storage chunks, whose workers write the next params in place)
    the previous work is joined here and ``state.pending`` is None; with it ``state.pending``
    stays the previous work, which :meth:`chunkjax.ChunkedStep.run_programs` waits on per
    program (:class:`Previous`)."""
    from chunkjax.host_work import HostWork
    prev = state.pending
    work = HostWork(step.host_deadline_s, getattr(prev, "backups", None), step.grad_window,
                    host_need(step, batch) if cross and step.host_chunks else None)
    previous = getattr(prev, "speculation", None) if prev is not None else state.speculation  # restored: Resumed
    if prev is not None and not cross:  # the storage chunks' last writes and commit run on (StorageRun)
        prev.join()
    return state._replace(pending=prev if cross else None, speculation=None), work, previous


def host_need(step, batch) -> dict[int, int]:
    """``{host chunk: index of the first program that takes it}`` for a (global) batch shape:
    the order the next step reads them in (chunks no program takes: not listed), from the
    step's programs (:meth:`chunkjax.ChunkedStep.program`, cached there per batch shape)."""
    host, need = set(step.host_chunks), {}
    for k in range(len(step.program_bounds())):
        for c in step.program(batch, k)[1]:
            if c in host:
                need.setdefault(c, k)
    return need


def next_read_fractions(fetch, segments, prefetch: int, n_stages: int) -> dict[int, float]:
    """The cost model's view of :func:`host_need`: ``{chunk: fraction of the forward done when the
    first program taking it starts}`` (0 to 1; the fused head and the backward count as 1), from
    a schedule's fetches (per moment, the chunks fetched for it, issued ``prefetch`` moments
    ahead, as :meth:`chunkjax.ChunkedStep.program` takes them) and program starts
    ``segments``. Chunks never fetched (device-resident params) are not listed."""
    T, k = len(fetch), int(prefetch)
    bounds = list(segments) + [T]
    first: dict[int, int] = {}
    for u, cs in enumerate(fetch):
        for c in cs:
            first.setdefault(c, u)
    n_fwd = max(1, n_stages - 1)
    ends = bounds[1:]
    out = {}
    for c, u in first.items():  # the first program whose end + prefetch passes u (else the last)
        i = bisect.bisect_right(ends, u - k)
        out[c] = min(1.0, (bounds[i] if i < len(ends) else bounds[-2]) / n_fwd)
    return out


class Previous:
    """The previous step's pending work as one call of :meth:`chunkjax.ChunkedStep.run_programs`
    sees it (module docstring, points 1 and 2).

    Args:
      work: the previous step's :class:`~chunkjax.host_work.HostWork`, or None (nothing to wait for).
      host: the step's host chunk ids.
    """

    def __init__(self, work, host):
        self.work, self.host = work, set(host)

    def before(self, args) -> None:
        """Before a program taking chunks ``args`` is dispatched: wait for those of them that are
        host chunks (raises the previous step's failure or
        :class:`~chunkjax.host_work.HostDeadlineError`)."""
        if self.work is not None:
            self.work.wait_chunks(sorted(self.host.intersection(args)))

    def join(self) -> None:
        """Before any gradient of this step is handed on (and at the end of the programs): join
        the whole previous work, once."""
        if self.work is not None:
            work, self.work = self.work, None
            work.join()


def abandon(work) -> None:
    """After a failed :meth:`chunkjax.ChunkedStep.begin`: wait for the step's own host work (the
    updates already handed over and the validation that rolls the speculated ones back) so that
    no thread of the failed step is left writing host chunks; its errors are dropped (the step's
    own error is the one raised)."""
    with contextlib.suppress(Exception):
        work.join()
