"""The host side of fitting a step (issue 21 item 4, issue 24 item 1): a schedule's host need as
the machine sees it, its check before anything is allocated, the measure the planner compares
with the host budget, and the re-plan when a plan's host need exceeds what the machine has.

Every function takes a :class:`chunkjax.fit.FitProblem` (``layout``, ``cb``, ``n_ranks``,
``zero_stage``, ``platform``, ``micro_batches``, ``mesh``, ``host_budget_bytes``).
"""
from __future__ import annotations

import dataclasses

from chunkjax.errors import HostBudgetError, PlanError
from chunkjax.plan import OVER_HOST_LIMIT
from chunkjax.plan_micro import passes_of
from chunkjax.speculate import DEFAULT_BACKUP_BYTES
from chunkjax.host_memory import (PINNED_HOST_LIMIT_ENV, PINNED_POOL_FRAGMENTATION, HostMemoryError, check_host_need,
                                  check_pinned_host, pinned_host_limit_bytes, schedule_host_need)

#: Re-plans with a lower host budget when a plan's host need (the pinned pool's growth, the
#: process) exceeds what the machine has (:func:`fit_host`).
MAX_HOST_REPLANS = 3
#: Share of the host bytes a plan leaves that speculative host updates may hold as backups
#: (:func:`speculation_bytes`); the rest stays free for what no plan counts (the kernel, caches).
SPECULATION_SHARE = 0.5


def host_need(problem, schedule) -> dict:
    """Host bytes a run of ``schedule`` needs, all ranks of this process together
    (:func:`chunkjax.host_memory.schedule_host_need`: the figure the planner compared with the
    host budget, ``predicted.host_bytes``, split by kind)."""
    p = problem  # in-program in one pass: no float32 sums outside the programs
    return schedule_host_need(schedule, p.cb, layout=p.layout, n_ranks=p.n_ranks, zero_stage=p.zero_stage,
                              platform=p.platform, micro_batches=passes_of(schedule, p.micro_batches))


def check_host_memory(problem, schedule, available: int | None = None) -> dict:
    """:func:`host_need` of ``schedule`` against ``available`` bytes (default
    :func:`chunkjax.host_memory.available_for_plan`); returns the need with ``available_bytes``.

    Raises:
      HostMemoryError: the need exceeds what is available (one line: what to change).
    """
    need = host_need(problem, schedule)
    if problem.mesh is None:  # the runtime's pinned-pool cap (each process of a mesh checks its own at init)
        check_pinned_host(need["pinned_host_bytes"], problem.platform)
    return check_host_need(need, "this plan", problem.platform, available)


def host_bytes_of(problem):
    """``schedule -> bytes`` the planner compares with the host budget on one device: what the
    machine gives the run beyond the process (the runtime's pinned pool as it grows,
    :func:`chunkjax.host_memory.pinned_pool_bytes`, plus pageable bytes), or more than any
    budget when the pinned bytes exceed what the runtime's pinned-pool cap lets a plan use
    (:func:`chunkjax.host_memory.pinned_usable_bytes`)."""
    cap = pinned_host_limit_bytes(problem.platform)
    cap = None if cap is None else int(cap * (1 - PINNED_POOL_FRAGMENTATION))  # what a plan may use of it

    def of(s) -> int:
        need = host_need(problem, s)
        if cap is not None and need["pinned_host_bytes"] > cap:
            return OVER_HOST_LIMIT
        return need["pinned_pool_bytes"] + need["pageable_bytes"]
    return of



def speculation_bytes(problem, host: dict, schedule=None) -> int | None:
    """The bound (bytes) of the speculative host updates' backup pool (:mod:`chunkjax.speculate`,
    used with clipping or a non-finite skip) for a plan whose host need is ``host`` (a
    :func:`check_host_memory` dict): :data:`SPECULATION_SHARE` of what the plan leaves of
    ``available_bytes``, less the speculated chunks' gradients kept beside the backups, at most
    :data:`chunkjax.speculate.DEFAULT_BACKUP_BYTES`; None when the available bytes are unknown
    (the step's own default then). Was unbounded by the plan: on the H200 the 8B full
    fine-tuning's backups filled 10 GiB the host check had not counted. With ``schedule``, also at most what its host-updated chunks can
    hold (each chunk's backup and kept gradient): the pool cannot use more, and a bound of
    gigabytes for a small model read as a need in the report (a fresh user's 2.77M-param model
    showed 8.46e9). With ``problem.rollback == "invert"`` there are no backups: the bound is the
    share of the spare bytes itself, at most the host-updated chunks' kept gradients (s23i, GPT3_6B
    with clipping that never fired: the backups' split of the share let 107 of 140 host chunks
    speculate; the rest waited for the norm, after the backward)."""
    avail = host.get("available_bytes")
    if avail is None:
        return None
    spare = max(0, int(avail) - int(host["need_bytes"]))
    cb = problem.cb
    backup, grad = cb.master + cb.opt, cb.grad  # one chunk's float32 state, and its gradient kept for a redo
    n_host = None if schedule is None else sum(u == "host" for u in schedule.update_locations)
    if getattr(problem, "rollback", "backup") == "invert":  # no backups: the bound holds the kept gradients alone
        most = DEFAULT_BACKUP_BYTES if n_host is None else min(DEFAULT_BACKUP_BYTES, n_host * grad)
        return int(min(most, SPECULATION_SHARE * spare))
    most = DEFAULT_BACKUP_BYTES if n_host is None else min(DEFAULT_BACKUP_BYTES, n_host * (backup + grad))
    return int(min(most, SPECULATION_SHARE * spare * backup / max(1, backup + grad)))


def pinned_limit_error(problem, budget_bytes: int) -> HostBudgetError:
    """The refusal of a plan whose every placement's pinned host bytes exceed the runtime's
    pinned-pool cap (:func:`chunkjax.host_memory.pinned_host_limit_bytes`), naming the setting."""
    cap = pinned_host_limit_bytes(problem.platform) or 0
    return HostBudgetError(
        f"at a device budget of {int(budget_bytes)} bytes every placement's pinned host bytes exceed the runtime's "
        f"pinned-host limit of {cap} bytes ({PINNED_HOST_LIMIT_ENV}={cap // 2**30}): raise "
        f"{PINNED_HOST_LIMIT_ENV}, use a larger device budget, or give storage directories", int(budget_bytes), False)


def fit_host(problem, sched, replan) -> tuple:
    """:func:`check_host_memory` of ``sched``; when it is refused and the plan has a host budget
    to lower (``replan(problem) -> schedule`` given), plan again with the host budget lowered by
    the overshoot (what the budget did not count: the pinned pool's growth by doubling, the
    process), at most :data:`MAX_HOST_REPLANS` times. Returns ``(problem, schedule, host need)``.

    Raises:
      HostMemoryError: the first refusal, when no re-plan fits.
    """
    first = None
    for _ in range(MAX_HOST_REPLANS + 1):
        try:
            return problem, sched, check_host_memory(problem, sched)
        except HostMemoryError as e:
            first = first or e
            if replan is None or problem.host_budget_bytes is None:
                raise first from None
            need = host_need(problem, sched)
            held = min(problem.host_budget_bytes, need["need_bytes"] - need["process_bytes"] - need["device_on_host_bytes"]
                       - need.get("system_bytes", 0))
            lower = held - (e.need_bytes - e.available_bytes) - problem.cb.params
            if lower <= 0:
                raise first from None
            problem = dataclasses.replace(problem, host_budget_bytes=int(lower))
            try:
                sched = replan(problem)
            except PlanError:
                raise first from None
    raise first
