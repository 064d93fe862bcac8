"""What a plan decides, as data: :class:`Placement`, :class:`Schedule` and its :class:`Prediction`.

A schedule is a pure description of one training step for one (model, layout, batch shape,
budget): where each chunk lives between steps, which chunks are fetched to the device at each
moment of the memory tide (:mod:`chunkjax.tide`) and released after it, where each chunk's
optimizer update runs, how the step is cut into jitted programs, and what all of it is predicted
to cost. :func:`chunkjax.plan.plan_schedule` makes one (the policies), :mod:`chunkjax.predict`
accounts for it, :func:`chunkjax.make_chunked_step` runs it. Nothing here allocates or plans.

PatrickStar (arXiv 2108.05818, sections 4.2-4.3 and 5) takes these decisions at run time from a
warm-up iteration; chunkjax takes them before the first step.
"""
from __future__ import annotations

import dataclasses

from chunkjax.cost import GRAD_WINDOW_PROGRAMS, PipelinedStepTime
from chunkjax.memory import DEVICE, PINNED_HOST

DEVICE_UPDATE, STREAMED_UPDATE, HOST_UPDATE, NO_UPDATE = "device", "streamed", "host", "none"
STORAGE_UPDATE = "storage"
#: where a chunk's optimizer update runs: ``device`` (state on the device), ``streamed`` (state in
#: pinned host memory, moved through the device for the update), ``host`` (updated in place in
#: host memory by a CPU kernel, :mod:`chunkjax.host_update`), ``storage`` (master params and
#: state in chunk files on a storage directory, updated next to it by a near-storage worker:
#: Smart-Infinity's SmartUpdate, :mod:`chunkjax.storage.updater`; compute params in pinned host
#: memory) or ``none`` (a frozen chunk, ``ChunkLayout.chunk_trainable`` False: params only, no
#: master, state, gradient or update)
UPDATE_LOCATIONS = (DEVICE_UPDATE, STREAMED_UPDATE, HOST_UPDATE, STORAGE_UPDATE, NO_UPDATE)
#: how a step runs micro-batches: every program once per micro-batch (:func:`chunkjax.accumulate.
#: mean_gradients`), or looped inside each moment (:class:`chunkjax.walker.Walk` ``micro_batches``)
PER_MICRO_BATCH, IN_PROGRAM = "per_micro_batch", "in_program"
ACCUMULATIONS = (PER_MICRO_BATCH, IN_PROGRAM)


def micro_group_size(accumulation: str, micro_group: int | None, micro_batches: int) -> int:
    """The micro-batches one pass of a step's programs loops over inside its moments: 1 per
    micro-batch (``"per_micro_batch"``), ``micro_batches`` in-program with ``micro_group`` None
    (one pass a step), else ``micro_group`` (in-program over groups: ``micro_batches //
    micro_group`` passes, :mod:`chunkjax.plan_micro`).

    Raises:
      ValueError: ``micro_group`` given per micro-batch, below 1, or not dividing ``micro_batches``.
    """
    if micro_group is None:
        return micro_batches if accumulation == IN_PROGRAM else 1
    if accumulation != IN_PROGRAM:
        raise ValueError(f"micro_group={micro_group} needs accumulation='in_program' (got {accumulation!r})")
    if not (isinstance(micro_group, int) and micro_group >= 1 and micro_batches % micro_group == 0):
        raise ValueError(f"micro_group={micro_group!r} must be an int >= 1 dividing micro_batches={micro_batches}")
    return micro_group


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each chunk lives between steps.

    Attributes:
      param_kinds: per chunk, memory kind of the compute-dtype params (``"device"`` or
        ``"pinned_host"``).
      state_kinds: per chunk, memory kind of the float32 master params and optimizer state.
      trainable: per chunk, False for a frozen chunk (no state, update location ``none``; its
        state kind is ignored); None: every chunk trainable.

    Raises:
      ValueError: the tuples differ in length, or a kind is not a memory kind.
    """

    param_kinds: tuple[str, ...]
    state_kinds: tuple[str, ...]
    trainable: tuple[bool, ...] | None = None

    def __post_init__(self):
        if len(self.param_kinds) != len(self.state_kinds):
            raise ValueError("param_kinds and state_kinds must have one entry per chunk")
        if self.trainable is not None and len(self.trainable) != len(self.param_kinds):
            raise ValueError("trainable must have one entry per chunk")
        if self.trainable is not None:  # all trainable is the default: one spelling, so placements compare equal
            tr = tuple(bool(t) for t in self.trainable)
            object.__setattr__(self, "trainable", None if all(tr) else tr)
        for k in self.param_kinds + self.state_kinds:
            if k not in (DEVICE, PINNED_HOST):
                raise ValueError(f"memory kind {k!r} is not 'device' or 'pinned_host'")

    @property
    def n_chunks(self) -> int:
        return len(self.param_kinds)

    @property
    def update_locations(self) -> tuple[str, ...]:
        """Per chunk: ``"device"``, ``"streamed"`` or ``"none"`` (frozen)."""
        tr = self.trainable or (True,) * self.n_chunks
        return tuple(NO_UPDATE if not t else DEVICE_UPDATE if k == DEVICE else STREAMED_UPDATE
                     for k, t in zip(self.state_kinds, tr))

    def grad_kind(self, c: int) -> str:
        """Memory kind a gradient chunk leaves the backward pass into."""
        return DEVICE if self.state_kinds[c] == DEVICE else PINNED_HOST

    @classmethod
    def uniform(cls, n_chunks: int, param_kind: str, state_kind: str) -> "Placement":
        return cls((param_kind,) * n_chunks, (state_kind,) * n_chunks)

    @classmethod
    def from_device_chunks(cls, n_chunks: int, on_device) -> "Placement":
        """Whole chunks (params and state) on the device for ids in ``on_device``, rest on host."""
        ks = tuple(DEVICE if c in set(on_device) else PINNED_HOST for c in range(n_chunks))
        return cls(ks, ks)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p, s in zip(self.param_kinds, self.state_kinds):
            key = f"params_{p}/state_{s}"
            out[key] = out.get(key, 0) + 1
        return out


def check_trainable(chunk_trainable, placement: Placement, schedule) -> None:
    """Raise ValueError (one line) unless ``placement`` and ``schedule`` (or None) agree with a
    layout's ``chunk_trainable`` on the frozen chunks (update location ``none``)."""
    if placement.trainable is not None and tuple(placement.trainable) != tuple(chunk_trainable):
        raise ValueError("placement.trainable differs from layout.chunk_trainable: plan with this layout")
    locs = () if schedule is None else schedule.update_locations
    bad = [c for c, (u, t) in enumerate(zip(locs, chunk_trainable)) if (u == NO_UPDATE) == t]
    if bad:
        raise ValueError(f"chunk {bad[0]}: the schedule's update location {locs[bad[0]]!r} does not match "
                         f"trainable={chunk_trainable[bad[0]]} in the layout: plan with this layout")


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What a schedule is predicted to cost per step (bytes, seconds); :mod:`chunkjax.predict`.

    Under ZeRO (``ranks > 1``) every figure is one rank's.

    Attributes:
      peak_device_bytes: largest device bytes at any moment or in the update phase.
      device_model_bytes: model data resident on the device between steps.
      host_model_bytes: model data and gradient buffers in host memory, every offloaded chunk's
        gradient counted (what a step moves through host memory).
      h2d_bytes_per_step / d2h_bytes_per_step: bytes moved each way per step.
      fetch_bytes_per_step: part of h2d that is chunk fetches during forward/backward.
      n_fetches: chunk fetches per step.
      device_bytes_per_moment: predicted device bytes at each moment (model + tide + buffers).
      time: predicted step time and where it goes.
      host_bytes: host bytes held at once: model data in host memory (a master-fetch chunk
        without its compute copy) plus :attr:`host_working_bytes`; what the host budget and the
        host-memory check compare (:mod:`chunkjax.host_forms`).
      host_working_bytes: host-updated chunks' gradients that exist at once (two programs',
        :func:`chunkjax.predict.grad_window_bytes`; with micro-batches also their float32 sums
        and means); streamed chunks' gradients are in :attr:`host_bytes` whole.
      host_bytes_per_param: :attr:`host_bytes` over every parameter of the layout (padding
        included).
      host_resident_bytes_per_param: host bytes of the chunks whose state lives in host memory
        (``host`` and ``streamed``) plus the working set, over their parameters (0.0: none).
      disk_bytes_per_step: bytes the ``storage`` chunks read and write on their storage
        directories per step (master params and optimizer state, each way; 0 without the disk
        tier).
      storage_chunks: chunks updated ``storage``.
      storage_host_bytes: host bytes of the near-storage workers' staging buffers (in
        :attr:`host_bytes`; :func:`chunkjax.host_memory.storage_host_bytes`).
      storage_workers: near-storage worker processes (one per storage directory; the rest of
        their bytes and the messages: :func:`chunkjax.host_memory.storage_process_bytes`, in the
        host need's process part).
    """

    peak_device_bytes: int
    device_model_bytes: int
    host_model_bytes: int
    h2d_bytes_per_step: int
    d2h_bytes_per_step: int
    fetch_bytes_per_step: int
    n_fetches: int
    device_bytes_per_moment: tuple[int, ...]
    time: PipelinedStepTime
    host_bytes: int = 0
    host_working_bytes: int = 0
    host_bytes_per_param: float = 0.0
    host_resident_bytes_per_param: float = 0.0
    disk_bytes_per_step: int = 0
    storage_chunks: int = 0
    storage_host_bytes: int = 0
    storage_workers: int = 0

    def to_dict(self) -> dict:
        """JSON-ready; without storage chunks the disk tier's keys are left out (as recorded before it)."""
        d = dataclasses.asdict(self)
        if not self.storage_chunks:
            del d["disk_bytes_per_step"], d["storage_chunks"], d["storage_host_bytes"], d["storage_workers"]
        d["time"] = self.time.to_dict()
        d["device_bytes_per_moment"] = list(self.device_bytes_per_moment)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Prediction":
        """The inverse of :meth:`to_dict`."""
        p = dict(d)
        p["time"] = PipelinedStepTime(**{f.name: p["time"][f.name] for f in dataclasses.fields(PipelinedStepTime)
                                         if f.name in p["time"]})  # older records: no storage time
        p["device_bytes_per_moment"] = tuple(p["device_bytes_per_moment"])
        if "disk_staging_bytes" in p:  # older records: the workers' staging buffers alone
            p["storage_host_bytes"] = p.pop("disk_staging_bytes")
        return cls(**p)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A static offload schedule for one (model, layout, batch shape, budget).

    Attributes:
      param_kinds: per chunk, memory kind of its compute params between steps.
      update_locations: per chunk, one of :data:`UPDATE_LOCATIONS`.
      fetch: per moment (tide order), host-param chunk ids fetched to the device for it.
      evict: per moment, chunk ids whose device copy is released after it (their next read,
        if any, is a fresh fetch).
      segments: moment index at which each jitted program of the step begins (starts with 0).
      prefetch: moments between issuing a fetch and the moment that reads it (>= 1).
      moments: per moment, ``(phase, stage)`` with phase as in :mod:`chunkjax.tide`.
      predicted: the :class:`Prediction`.
      budget_bytes: the device budget planned for (bytes; each rank's under ZeRO).
      master_fetch: ids of ``host``-updated chunks kept in the *master-fetch* form: no
        compute-dtype copy on the host, the float32 master params in pinned host memory are what
        a fetch reads (4 bytes per element up) and are cast to the compute dtype on the device
        (:func:`chunkjax.host_forms.assign_host_forms`); the other host chunks keep a
        compute-dtype copy in pinned host memory. Empty on a mesh.
      streamed_early: the step starts each streamed chunk's update as the program completing its
        gradient ends (:mod:`chunkjax.streamed`; only where the update does not read the global
        norm), False: after the backward; the prediction assumes the same.
      grad_window: programs whose host-chunk gradients may exist at once: after handing a
        program's host gradients over, the step waits until the host thread is done with the
        hand-off ``grad_window - 1`` before it (:meth:`chunkjax.updaters.HostWork.hand_over`);
        the planner chooses it with the segments (:func:`chunkjax.plan.choose_program_cut`).
      accumulation: how the step runs micro-batches (:data:`ACCUMULATIONS`;
        :attr:`chunkjax.step.ChunkedStep.accumulation`): ``"in_program"`` when planned on the
        in-program traces (:func:`chunkjax.trace.in_program_traces`), else ``"per_micro_batch"``.
      micro_group: with ``"in_program"``: the micro-batches each pass loops over inside its
        moments (micro-batch groups: the programs run ``micro_batches // micro_group`` passes a
        step, the passes' gradients summed as per micro-batch); None: all of the step's (one pass).
        :func:`micro_group_size`.
      remat: per stage, its remat option (:data:`chunkjax.remat.REMAT_OPTIONS`: ``"full"``
        recompute, ``"save"`` named activations kept on the device, ``"offload"`` kept in pinned
        host memory); empty: every stage ``"full"``. The prediction accounts it (the traces it was
        planned with: :func:`chunkjax.remat.with_remat`).
      remat_names: the ``checkpoint_name`` names the ``"save"``/``"offload"`` stages keep.
      unroll_micro_batches: with ``"in_program"``: the moments' micro-batch loops are traced
        unrolled (:class:`chunkjax.walker.Walk` ``unroll``: the same operations in the same
        order, bit for bit the loop's results, one copy of a stage's code per micro-batch), so
        XLA may overlap a moment's chunk fetches with them; False: while loops (``lax.scan``),
        whose backward fetches the cost model times after the loop (the prediction assumes
        the one the schedule names: :func:`chunkjax.predict.looped_fetch`).

    Raises:
      ValueError: per-chunk tuples of different lengths, an unknown update location or accumulation,
        segments that do not start at 0 and increase, or a ``master_fetch`` chunk that is not
        host-updated with its params in pinned host memory.
    """

    param_kinds: tuple[str, ...]
    update_locations: tuple[str, ...]
    fetch: tuple[tuple[int, ...], ...]
    evict: tuple[tuple[int, ...], ...]
    segments: tuple[int, ...]
    prefetch: int
    moments: tuple[tuple[str, int], ...]
    predicted: Prediction
    budget_bytes: int
    master_fetch: tuple[int, ...] = ()
    streamed_early: bool = False
    grad_window: int = GRAD_WINDOW_PROGRAMS
    accumulation: str = PER_MICRO_BATCH
    micro_group: int | None = None
    remat: tuple[str, ...] = ()
    remat_names: tuple[str, ...] = ()
    unroll_micro_batches: bool = False

    def __post_init__(self):
        from chunkjax.remat import check_remat
        check_remat(self.remat, (len(self.moments) + 1) // 2, self.remat_names)
        if self.accumulation not in ACCUMULATIONS:
            raise ValueError(f"accumulation={self.accumulation!r}: use one of {ACCUMULATIONS}")
        if self.micro_group is not None:
            micro_group_size(self.accumulation, self.micro_group, self.micro_group)
        if len(self.param_kinds) != len(self.update_locations):
            raise ValueError("param_kinds and update_locations need one entry per chunk")
        bad = [c for c in self.master_fetch if not (0 <= c < len(self.param_kinds))
               or self.update_locations[c] != HOST_UPDATE or self.param_kinds[c] != PINNED_HOST]
        if bad:
            raise ValueError(f"master_fetch chunk {bad[0]} is not host-updated with its params in pinned_host: "
                             "only such chunks can be fetched from their float32 master params")
        for u in self.update_locations:
            if u not in UPDATE_LOCATIONS:
                raise ValueError(f"update location {u!r} is not one of {UPDATE_LOCATIONS}")
        if not self.segments or self.segments[0] != 0 or list(self.segments) != sorted(set(self.segments)):
            raise ValueError(f"segments must start at 0 and increase, got {self.segments}")
        if int(self.grad_window) < 1:
            raise ValueError(f"grad_window must be >= 1 program, got {self.grad_window}")

    @property
    def n_chunks(self) -> int:
        return len(self.param_kinds)

    @property
    def placement(self) -> Placement:
        """The placement between steps (state of ``host``/``streamed`` chunks is on the host; of
        ``storage`` chunks on disk, their gradients leaving to pinned host memory as the host's)."""
        return Placement(self.param_kinds,
                         tuple(DEVICE if u == DEVICE_UPDATE else PINNED_HOST for u in self.update_locations),
                         tuple(u != NO_UPDATE for u in self.update_locations) if NO_UPDATE in self.update_locations
                         else None)

    def counts(self) -> dict[str, int]:
        """Chunks per (params kind, update location)."""
        out: dict[str, int] = {}
        for p, u in zip(self.param_kinds, self.update_locations):
            k = f"params_{p}/update_{u}"
            out[k] = out.get(k, 0) + 1
        return out

    def residency(self) -> list[list[bool]]:
        """Per chunk, per moment: is a copy of the chunk's compute params on the device."""
        T = len(self.moments)
        res = [[self.param_kinds[c] == DEVICE] * T for c in range(self.n_chunks)]
        live: set[int] = set()
        for t in range(T):
            live |= set(self.fetch[t])
            for c in live:
                res[c][t] = True
            live -= set(self.evict[t])
        return res

    def to_dict(self) -> dict:
        return {"param_kinds": list(self.param_kinds), "update_locations": list(self.update_locations),
                "fetch": [list(f) for f in self.fetch], "evict": [list(e) for e in self.evict],
                "segments": list(self.segments), "prefetch": self.prefetch,
                "moments": [list(m) for m in self.moments], "counts": self.counts(),
                "budget_bytes": self.budget_bytes, "predicted": self.predicted.to_dict(),
                "master_fetch": list(self.master_fetch), "streamed_early": self.streamed_early,
                "grad_window": int(self.grad_window), "accumulation": self.accumulation,
                "micro_group": self.micro_group, "remat": list(self.remat), "remat_names": list(self.remat_names),
                "unroll_micro_batches": bool(self.unroll_micro_batches)}

    @classmethod
    def from_dict(cls, d: dict) -> "Schedule":
        """The inverse of :meth:`to_dict` (e.g. a schedule recorded in a results JSON)."""
        return cls(tuple(d["param_kinds"]), tuple(d["update_locations"]), tuple(tuple(f) for f in d["fetch"]),
                   tuple(tuple(e) for e in d["evict"]), tuple(d["segments"]), int(d["prefetch"]),
                   tuple(tuple(m) for m in d["moments"]), Prediction.from_dict(d["predicted"]),
                   int(d["budget_bytes"]), tuple(int(c) for c in d.get("master_fetch", ())),
                   bool(d.get("streamed_early", False)), int(d.get("grad_window", GRAD_WINDOW_PROGRAMS)),
                   d.get("accumulation", PER_MICRO_BATCH), d.get("micro_group"), tuple(d.get("remat", ())),
                   tuple(d.get("remat_names", ())), bool(d.get("unroll_micro_batches", False)))
