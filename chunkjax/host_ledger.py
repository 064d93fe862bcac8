"""The host-memory ledger: this process's resident memory read at named phases, beside the plan's
accounted host parts (issue 24: a plan that fit on paper was killed by the kernel's OOM killer in
its first step, and nothing said which part the accounting had missed).

Linux splits a process's resident memory (``/proc/self/status``) into ``RssAnon`` (malloc'd and
mmap'd private memory: numpy buffers, the Python heap, the compiler's working memory, on the CPU
the device's buffers), ``RssShmem`` (shared memory: on a GPU the runtime's pinned-host pool, which
the CUDA driver maps as shared) and ``RssFile`` (mapped files: the shared libraries). A
:class:`HostLedger` records them at the phases a caller names (after import, after planning, after
compiling, after initialising the state, after each step) and lays them beside the plan's parts
(:func:`chunkjax.host_memory.schedule_host_parts`), so a run that is killed has already printed
its prediction and the RSS it had reached.

Nothing here is global: a ledger is an object its caller owns and passes on.
"""
from __future__ import annotations

import ctypes
import dataclasses
import time

from chunkjax.host_memory import host_memory_available_bytes, schedule_host_parts, storage_process_bytes
from chunkjax.plan_micro import passes_of

#: Accounted parts held outside this process (the near-storage workers, the rest of the machine):
#: not in its predicted peak RSS (the trainer's few messages to the workers counted with them).
OUTSIDE_PARTS = ("storage_workers", "storage_processes", "system_reserve")

#: ``/proc/self/status`` fields a sample reads (kB there, bytes here).
_STATUS_FIELDS = {"RssAnon:": "anon_bytes", "RssShmem:": "shmem_bytes", "RssFile:": "file_bytes",
                  "VmHWM:": "hwm_bytes"}


def rss_parts(status_path: str = "/proc/self/status") -> dict[str, int] | None:
    """This process's resident memory by kind (bytes): ``anon_bytes`` (``RssAnon``),
    ``shmem_bytes`` (``RssShmem``: on a GPU the pinned-host pool), ``file_bytes`` (``RssFile``) and
    ``hwm_bytes`` (``VmHWM``, the peak of their sum); None where the file cannot be read (not
    Linux)."""
    out = {}
    try:
        with open(status_path) as fh:
            for line in fh:
                key = line.split(None, 1)[0] if line.strip() else ""
                if key in _STATUS_FIELDS:
                    out[_STATUS_FIELDS[key]] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return out or None


def release_free_heap() -> int | None:
    """Return the C heap's free pages to the kernel: glibc's ``malloc_trim(0)`` (every arena;
    what Python, numpy and XLA freed stays mapped by the allocator until then). Returns the
    drop of ``RssAnon`` in bytes (may be 0), or None where the C library is not glibc."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    before = (rss_parts() or {}).get("anon_bytes", 0)
    trim(ctypes.c_size_t(0))
    return max(0, before - (rss_parts() or {}).get("anon_bytes", 0))


def plan_parts(problem, schedule, host: dict) -> dict[str, int]:
    """The host bytes a fitted plan accounts, by part (bytes): :func:`chunkjax.host_memory.schedule_host_parts`
    of ``schedule`` for ``problem`` (a :class:`chunkjax.fit.FitProblem`; in-program accumulation
    in one pass has no host sums: :func:`chunkjax.plan_micro.passes_of`), then ``pinned_pool_rounding`` (what the
    runtime's pinned pool holds above the pinned bytes), ``storage_processes`` (the near-storage workers beside their
    staging buffers, with the trainer's messages: :func:`chunkjax.host_memory.storage_process_bytes`),
    ``process_allowance`` (the process's own need the plan counts), ``system_reserve`` (what the
    rest of the machine grows by beside the run: :func:`chunkjax.host_memory.system_host_bytes`) and
    ``total_bytes`` (the need that ``MemAvailable``, read when planning, must cover; ``host``: the
    fit's host need, :func:`chunkjax.fit_host.host_need`)."""
    parts = schedule_host_parts(schedule, problem.cb, n_ranks=problem.n_ranks, zero_stage=problem.zero_stage,
                                platform=problem.platform, micro_batches=passes_of(schedule, problem.micro_batches))
    parts["pinned_pool_rounding"] = int(host["pinned_pool_bytes"] - host["pinned_host_bytes"])
    workers = storage_process_bytes(getattr(schedule.predicted, "storage_workers", 0), problem.cb.grad)
    parts["storage_processes"] = workers  # the near-storage workers beside their staging buffers
    parts["process_allowance"] = int(host["process_bytes"]) - workers
    parts["system_reserve"] = int(host.get("system_bytes", 0))
    parts["total_bytes"] = int(host["need_bytes"])
    return parts


@dataclasses.dataclass(frozen=True)
class RssSample:
    """Resident memory of this process at one phase (bytes; None where unreadable).

    Attributes:
      phase: the caller's name for the moment ("import", "plan", "compile", "init", "step 1", ...).
      t_s: seconds since the ledger was created.
      anon_bytes, shmem_bytes, file_bytes, hwm_bytes: :func:`rss_parts`.
      available_bytes: ``MemAvailable`` of the machine.
    """

    phase: str
    t_s: float
    anon_bytes: int | None
    shmem_bytes: int | None
    file_bytes: int | None
    hwm_bytes: int | None
    available_bytes: int | None

    @property
    def resident_bytes(self) -> int | None:
        """``anon_bytes + shmem_bytes``: what the run holds of the machine's memory (the mapped
        libraries aside)."""
        return None if self.anon_bytes is None else self.anon_bytes + (self.shmem_bytes or 0)


class HostLedger:
    """Resident memory at named phases, beside the plan's accounted host parts (bytes).

    Args:
      echo: called with each sample's one-line text when it is taken (e.g. ``print``); None: quiet.

    Attributes:
      samples: the :class:`RssSample` s in order.
      accounted: the plan's host parts (:meth:`account`), {} until given.
    """

    def __init__(self, echo=None):
        self._t0 = time.monotonic()
        self.samples: list[RssSample] = []
        self.accounted: dict[str, int] = {}
        self._echo = echo

    def mark(self, phase: str) -> RssSample:
        """Read the resident memory now and record it under ``phase``; returns the sample."""
        parts = rss_parts() or {}
        s = RssSample(str(phase), round(time.monotonic() - self._t0, 3), parts.get("anon_bytes"),
                      parts.get("shmem_bytes"), parts.get("file_bytes"), parts.get("hwm_bytes"),
                      host_memory_available_bytes())
        self.samples.append(s)
        if self._echo is not None:
            self._echo(self.line(s))
        return s

    def account(self, parts: dict[str, int], held_at: str | None = None, echo: bool = True) -> None:
        """Keep the plan's host parts (a dict of bytes, e.g. :func:`plan_parts`) and, with
        ``echo``, print them in one line: a run killed later has shown its prediction.
        ``held_at``: the phase at which the plan read ``MemAvailable`` (its need comes on top of
        what the process held then): kept as ``held_when_planned`` and, with ``total_bytes``,
        ``predicted_peak_bytes`` (the resident bytes this process should peak at: the total less
        :data:`OUTSIDE_PARTS`)."""
        self.accounted = {k: int(v) for k, v in parts.items()}
        held = self.sample(held_at) if held_at is not None else None
        if held is not None and held.resident_bytes is not None:
            self.accounted["held_when_planned"] = held.resident_bytes
            if "total_bytes" in self.accounted:  # this process's: the workers and the rest of the system aside
                outside = sum(self.accounted.get(k, 0) for k in OUTSIDE_PARTS)
                self.accounted["predicted_peak_bytes"] = held.resident_bytes + self.accounted["total_bytes"] - outside
        if echo and self._echo is not None:
            self._echo(self.accounted_line())

    def sample(self, phase: str) -> RssSample | None:
        """The last sample named ``phase``, None if there is none."""
        return next((s for s in reversed(self.samples) if s.phase == phase), None)

    def growth(self, start: str, end: str) -> dict[str, int] | None:
        """Bytes each kind grew by from phase ``start`` to phase ``end`` (``anon_bytes``,
        ``shmem_bytes``, ``resident_bytes``), None when a phase or a reading is missing."""
        a, b = self.sample(start), self.sample(end)
        if a is None or b is None or a.anon_bytes is None or b.anon_bytes is None:
            return None
        return {"anon_bytes": b.anon_bytes - a.anon_bytes, "shmem_bytes": (b.shmem_bytes or 0) - (a.shmem_bytes or 0),
                "resident_bytes": b.resident_bytes - a.resident_bytes}

    @staticmethod
    def line(s: RssSample) -> str:
        """One line of a sample, in GiB (2**30 bytes: host memory held, the unit budgets are given in)."""
        gib = lambda b: "n/a" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
        return (f"[host-ledger] {s.phase}: anon {gib(s.anon_bytes)} GiB, shmem {gib(s.shmem_bytes)} GiB, peak "
                f"{gib(s.hwm_bytes)} GiB, MemAvailable {gib(s.available_bytes)} GiB ({s.t_s:.1f} s)")

    def accounted_line(self) -> str:
        """The plan's host parts in one line, in GiB (2**30 bytes), the total first."""
        own = ("total_bytes", "held_when_planned", "predicted_peak_bytes")
        parts = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in self.accounted.items() if v and k not in own)
        total = self.accounted.get("total_bytes", sum(v for k, v in self.accounted.items() if k not in own))
        peak = self.accounted.get("predicted_peak_bytes")
        return (f"[host-ledger] plan accounts {total / 2**30:.2f} GiB of host: {parts}"
                + (f"; with the {self.accounted['held_when_planned'] / 2**30:.2f} GiB held when planned, a predicted "
                   f"peak of {peak / 2**30:.2f} GiB resident" if peak is not None else ""))

    def to_dict(self) -> dict:
        """``{"phases": [sample as dict ...], "accounted": {part: bytes}}`` (JSON-ready)."""
        return {"phases": [dataclasses.asdict(s) for s in self.samples], "accounted": dict(self.accounted)}
