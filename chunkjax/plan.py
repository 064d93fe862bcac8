"""Placement of chunks and the memory/transfer accounting of a step (pure: allocates nothing).

A :class:`Placement` says, per chunk, where its compute params live between steps and where its
master params and optimizer state live (so where its update runs: *device* when the state is on
the device, *streamed* when the state is in pinned host memory and is moved through the device
for the update). :func:`account` turns (layout, placement, stage activation trace) into predicted
peak device bytes and bytes moved each way per step; :func:`plan_fixed` is the simple fixed rule
of the foundation issue: whole chunks go to the device in first-use order while the accounted
peak stays under the budget (PatrickStar, section 4.2: chunks that do not fit stay on the CPU).

The traced memory tide and Belady eviction of the full planner build on the same accounting.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from chunkjax.layout import ChunkLayout
from chunkjax.memory import DEVICE, PINNED_HOST

_MSG_INFEASIBLE = (
    "device budget {budget} bytes is below the {need} bytes this step needs with every chunk in "
    "pinned host memory (activations and temporaries {act} bytes, chunk buffers {buf} bytes){why}: "
    "use --device-budget >= {need_gib:.3f}GiB{fix}"
)


def _gib_ceil(n: int) -> float:
    """``n`` bytes in GiB rounded *up* to the 3 decimals the message prints (rounding to nearest
    could suggest a budget below ``n``, which then fails again)."""
    return -(-n * 1000 // 2**30) / 1000


class PlanError(ValueError):
    """No placement fits the device budget (the message gives the smallest budget that does)."""

    def __init__(self, msg: str, min_budget_bytes: int, activations_alone: bool):
        super().__init__(msg)
        self.min_budget_bytes = min_budget_bytes
        self.activations_alone = activations_alone


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each chunk lives between steps.

    Attributes:
      param_kinds: per chunk, memory kind of the compute-dtype params.
      state_kinds: per chunk, memory kind of the float32 master params and optimizer state.
    """

    param_kinds: tuple[str, ...]
    state_kinds: tuple[str, ...]

    def __post_init__(self):
        if len(self.param_kinds) != len(self.state_kinds):
            raise ValueError("param_kinds and state_kinds must have one entry per chunk")
        for k in self.param_kinds + self.state_kinds:
            if k not in (DEVICE, PINNED_HOST):
                raise ValueError(f"memory kind {k!r} is not 'device' or 'pinned_host'")

    @property
    def n_chunks(self) -> int:
        return len(self.param_kinds)

    @property
    def update_locations(self) -> tuple[str, ...]:
        """Per chunk: ``"device"`` or ``"streamed"``."""
        return tuple("device" if k == DEVICE else "streamed" for k in self.state_kinds)

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


@dataclasses.dataclass(frozen=True)
class StageTrace:
    """Non-model memory of one stage, from tracing it on abstract inputs.

    Attributes:
      name: the stage's name.
      chunks: chunk ids the stage reads.
      input_bytes: bytes of the activation saved at the stage's input (kept until its backward).
      temp_bytes: peak transient bytes of the stage's recompute + vjp (compiled memory analysis).
      bwd_chunks: chunk ids whose values the stage's backward needs (a subset of ``chunks``;
        an embedding lookup's gradient needs none). ``None`` means all of ``chunks``.
    """

    name: str
    chunks: tuple[int, ...]
    input_bytes: int
    temp_bytes: int
    bwd_chunks: tuple[int, ...] | None = None

    @property
    def backward_chunks(self) -> tuple[int, ...]:
        return self.chunks if self.bwd_chunks is None else self.bwd_chunks


@dataclasses.dataclass(frozen=True)
class Accounting:
    """Predicted memory and traffic of one training step (all bytes)."""

    peak_device_bytes: int
    device_model_bytes: int
    non_model_peak_bytes: int
    h2d_bytes_per_step: int
    d2h_bytes_per_step: int
    fetches_per_step: int
    fwd_bwd_h2d_bytes: int = 0      # chunk fetches during forward/backward
    fwd_bwd_d2h_bytes: int = 0      # gradient chunks leaving the backward pass
    host_model_bytes: int = 0       # model data and gradient buffers in pinned host memory

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ChunkBytes:
    """Bytes of one chunk in each chunk list."""

    params: int   # compute dtype
    grad: int     # compute dtype
    master: int   # float32
    opt: int      # optimizer state (all leaves of the chunk's optax state)

    @property
    def state(self) -> int:
        return self.master + self.opt


def chunk_bytes(layout: ChunkLayout, compute_dtype, opt_state_bytes: int) -> ChunkBytes:
    cs = layout.chunk_size
    it = np.dtype(compute_dtype).itemsize
    return ChunkBytes(params=cs * it, grad=cs * it, master=cs * 4, opt=opt_state_bytes)


def fetch_events(traces, placement: Placement, prefetch: int) -> tuple[list[list[int]], list[list[int]]]:
    """Host-param chunk fetches per stage, forward and backward, under the fixed rule.

    A chunk read by stage ``s`` is fetched at stage ``s - prefetch`` (forward) unless it is still
    held from the previous stage that read it within the prefetch window; the backward pass
    mirrors this in reverse. Returns (forward, backward) lists of chunk ids fetched, per stage
    (backward indexed by stage too). The last stage runs once (its forward is fused with its
    backward).
    """
    n = len(traces)
    fwd = [[] for _ in range(n)]
    bwd = [[] for _ in range(n)]
    for order, out in ((range(n), fwd), (range(n - 1, -1, -1), bwd)):
        order = list(order)
        if out is bwd:
            order = order[1:]  # head already ran in the forward order's last position
        held: dict[int, int] = {}  # chunk -> position of last use
        for pos, s in enumerate(order):
            needed = traces[s].chunks if out is fwd else traces[s].backward_chunks
            for c in needed:
                if placement.param_kinds[c] != PINNED_HOST:
                    continue
                if c in held and pos - held[c] <= max(prefetch, 1):
                    held[c] = pos
                    continue
                out[s].append(c)
                held[c] = pos
    return fwd, bwd


def account(layout: ChunkLayout, placement: Placement, traces: tuple[StageTrace, ...],
            cb: ChunkBytes, prefetch: int = 1, host_update: bool = False) -> Accounting:
    """Predict peak device bytes and per-step traffic for a placement.

    Peak = model data resident on the device + every saved stage input + the largest moment of
    (chunk buffers fetched for the prefetch window + gradient accumulators (float32) alive +
    gradients of device-updated chunks waiting for the update + the stage's temporaries), or the
    update phase (one streamed chunk's grad, master, state and params on the device), whichever
    is larger.
    """
    n = placement.n_chunks
    dev_model = sum((cb.params if placement.param_kinds[c] == DEVICE else 0)
                    + (cb.state if placement.state_kinds[c] == DEVICE else 0) for c in range(n))
    saved = sum(t.input_bytes for t in traces[1:])
    # first (forward order) stage reading each chunk: its gradient is complete after that stage's
    # backward; last reader: its accumulator opens at that stage's backward
    first = {c: min(s for s, t in enumerate(traces) if c in t.chunks) for c in range(n)
             if any(c in t.chunks for t in traces)}
    last = {c: max(s for s, t in enumerate(traces) if c in t.chunks) for c in first}
    window = max(prefetch, 1)
    worst = 0
    for s, t in enumerate(traces):
        near = {c for s2 in range(s, min(len(traces), s + window + 1)) for c in traces[s2].chunks}
        fetched = sum(cb.params for c in near if placement.param_kinds[c] == PINNED_HOST)
        acc = sum(layout.chunk_size * 4 for c in first if first[c] <= s <= last[c])
        waiting = sum(cb.grad for c in first if placement.state_kinds[c] == DEVICE and first[c] >= s)
        worst = max(worst, fetched + acc + waiting + t.temp_bytes)
    streamed = [c for c in range(n) if placement.state_kinds[c] == PINNED_HOST]
    all_dev_grads = sum(cb.grad for c in range(n) if placement.state_kinds[c] == DEVICE)
    # update phase: the device group first (its gradients plus float32 temporaries of one chunk),
    # then one streamed chunk at a time (grad, master, state and old/new params on the device)
    device_update = all_dev_grads + 2 * layout.chunk_size * 4 if all_dev_grads else 0
    streamed_update = (cb.grad + cb.state + 2 * cb.params) if streamed else 0
    non_model = saved + worst
    peak = dev_model + max(non_model, device_update, streamed_update)
    fwd, bwd = fetch_events(traces, placement, prefetch)
    n_fetch = sum(len(x) for x in fwd) + sum(len(x) for x in bwd)
    fb_h2d = n_fetch * cb.params
    fb_d2h = len(streamed) * cb.grad
    h2d, d2h = fb_h2d, fb_d2h
    for c in streamed:
        if host_update:  # updated in place on the host: only new compute params come back up
            h2d += cb.params if placement.param_kinds[c] == DEVICE else 0
        else:  # streamed: grad and state up, state (and host-kind params) back down
            d2h += cb.state + (cb.params if placement.param_kinds[c] == PINNED_HOST else 0)
            h2d += cb.grad + cb.state
    # chunks whose params are on the host but state on the device: new params go back down
    for c in range(n):
        if placement.state_kinds[c] == DEVICE and placement.param_kinds[c] == PINNED_HOST:
            d2h += cb.params
    host = sum((cb.params if placement.param_kinds[c] == PINNED_HOST else 0)
               + (cb.state + cb.grad if placement.state_kinds[c] == PINNED_HOST else 0) for c in range(n))
    return Accounting(peak_device_bytes=int(peak), device_model_bytes=int(dev_model),
                      non_model_peak_bytes=int(non_model), h2d_bytes_per_step=int(h2d),
                      d2h_bytes_per_step=int(d2h), fetches_per_step=int(n_fetch),
                      fwd_bwd_h2d_bytes=int(fb_h2d), fwd_bwd_d2h_bytes=int(fb_d2h), host_model_bytes=int(host))


def plan_fixed(layout: ChunkLayout, traces: tuple[StageTrace, ...], cb: ChunkBytes,
               budget_bytes: int, prefetch: int = 1) -> tuple[Placement, Accounting]:
    """The fixed rule: first the compute params of chunks (in first-use order), then their master
    params and optimizer state, go to the device while the accounted peak fits ``budget_bytes``;
    everything else stays in pinned host memory.

    Compute params first: a resident param chunk saves its fetch in forward and backward for
    ``2 x compute-dtype`` bytes of device memory, the cheapest traffic saved per byte (ZeRO-Offload's
    split when the budget holds all params); state placed on the device also moves the chunk's
    update there (PatrickStar, section 5).

    Raises:
      PlanError: even the all-host placement exceeds the budget; the message gives the
        smallest budget that works and says whether activations alone exceed the budget.
    """
    n = layout.n_chunks
    host = Placement.uniform(n, PINNED_HOST, PINNED_HOST)
    acc_host = account(layout, host, traces, cb, prefetch)
    if acc_host.peak_device_bytes > budget_bytes:
        act = sum(t.input_bytes for t in traces[1:]) + max(t.temp_bytes for t in traces)
        alone = act > budget_bytes
        why = "; activations alone exceed the budget" if alone else ""
        fix = " or lower the batch / sequence length (activations are checkpointed per block)" if alone else ""
        need = acc_host.peak_device_bytes
        raise PlanError(_MSG_INFEASIBLE.format(budget=budget_bytes, need=need, act=act,
                                               buf=need - act, why=why, need_gib=_gib_ceil(need), fix=fix),
                        need, alone)
    pk, sk = [PINNED_HOST] * n, [PINNED_HOST] * n
    best = (host, acc_host)
    for kinds in (pk, sk):
        for c in range(n):
            kinds[c] = DEVICE
            trial = Placement(tuple(pk), tuple(sk))
            acc = account(layout, trial, traces, cb, prefetch)
            if acc.peak_device_bytes <= budget_bytes:
                best = (trial, acc)
            else:
                kinds[c] = PINNED_HOST
    return best


def parse_bytes(text: str) -> int:
    """Parse ``"8GiB"``, ``"512MiB"``, ``"24GB"``, ``"1e9"`` or ``"123456"`` into bytes.

    Raises:
      ValueError: unparsable (one line naming the accepted forms).
    """
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    t = str(text).strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        val = float(num)
    except ValueError:
        val = None
    if val is None or unit not in units or not math.isfinite(val):
        raise ValueError(f"cannot parse {text!r} as a byte size: use e.g. 8GiB, 512MiB, 24GB or a plain byte count")
    if val <= 0:
        raise ValueError(f"a byte size must be positive, got {text!r}: use e.g. 8GiB, 512MiB or 24GB")
    return int(val * units[unit])
