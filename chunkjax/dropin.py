"""The drop-in optimizer's update: where each offloaded chunk is updated, and one step's pipeline.

:class:`chunkjax.ChunkedOptimizer` keeps a chunk's float32 master params and optimizer state on
the device while they fit its budget (ZeRO-Offload's split, :func:`chunkjax.plan_schedule`'s
``"optimizer_only"`` policy); the other chunks' state lives in pinned host memory and is updated
at one of PatrickStar's update locations (Fang et al., arXiv 2108.05818, section 5):

* **streamed** (the device): master + state move to the device, the chunk is updated there by
  the unchanged optax transformation (:func:`chunkjax.optim.update_chunk`) and moves back; a
  float32 chunk moves its state only, its master being the params the optimizer returned last
  (:attr:`ChunkPrograms.update_lean`, :func:`lean_chunks`);
* **host**: the numba kernel (:func:`host_chunk_step`, arithmetic of :mod:`chunkjax.kernels`)
  updates master and moments in place; only the gradient goes to the host and the new compute
  params come back. Only for a host kernel spec
  (``chunkjax.host_update.AdamW / Lion / SGDMomentum``) given as ``tx``.

:func:`split_offloaded` (:mod:`chunkjax.dropin_cost`, re-exported here) divides the offloaded
chunks between the two by rate (:func:`predict_update_s`: the PCIe bytes of each direction
against the host kernel's time and the host memory's time, which the kernel and the DMA share,
all running in parallel; ZeRO-Offload++ / ZenFlow's GPU-CPU split).

One step runs both locations at once on :class:`chunkjax.duplex.DuplexUpdate`'s threads (one
per PCIe direction, one for the host kernel): ``depth`` streamed chunks' state on the device at
once, the host chunks' gradients sent from the user's gradient leaves as they are (no packing
on the device: :func:`host_sends`) and updated piece by piece as they land
(:func:`host_chunk_step`), their new params sent back as each kernel finishes.

The drop-in's programs (:class:`ChunkPrograms`: one set per chunk shape, :func:`sub_layout`) and
its placement (:func:`place`: the ``"optimizer_only"`` policy with room for the pipeline) are
here too.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from chunkjax import optim
from chunkjax.cost import Rates
from chunkjax.errors import PlanError
from chunkjax.layout import ChunkLayout, LeafSlot, Piece
from chunkjax.memory import DEVICE, PINNED_HOST, sharding
from chunkjax.plan import plan_schedule
from chunkjax.dropin_cost import (DEFAULT_RATES, UpdateTime, host_kernel_bytes, lean_chunks,  # noqa: F401 (the drop-in's API)
                                  predict_update_parts, predict_update_s, split_offloaded, streamed_bytes)


_MSG_TX = ("tx must be an optax.GradientTransformation or a host kernel spec (chunkjax.host_update.AdamW / Lion / "
           "SGDMomentum), got {type}")


#: One chunk's device update may use at most this fraction of the budget when the chunk size is
#: searched (room for resident chunks and a pipeline of a few streamed ones).
CHUNK_BUDGET_FRACTION = 1 / 6
#: Device bytes per element of one chunk's update besides its master + state: a float32 gradient,
#: two float32 temporaries and the new params (chunkjax.predict.update_working_bytes' rule).
UPDATE_BYTES_PER_ELEMENT = 16


def min_chunks_for_budget(n_elements: int, state_bytes_per_element: float, budget: int) -> int:
    """The fewest chunks for which one chunk's device update (its master + optimizer state,
    ``state_bytes_per_element`` plus 4, and :data:`UPDATE_BYTES_PER_ELEMENT`) needs at most
    :data:`CHUNK_BUDGET_FRACTION` of ``budget`` bytes: e.g. 1.28e9 AdamW params at 2 GiB give 60+
    chunks (about 18M elements) instead of 26 of 51M, room for a pipeline of 3 and resident chunks.
    1 when the whole model's update fits that fraction."""
    per_element = UPDATE_BYTES_PER_ELEMENT + 4 + state_bytes_per_element
    cap = max(1, int(budget * CHUNK_BUDGET_FRACTION / per_element))
    return max(1, -(-int(n_elements) // cap))




# ---- the drop-in's input checks ----------------------------------------------------------------

def budget_bytes(device_budget: int | float | str) -> int | str:
    """The drop-in's budget: bytes or ``"min"`` (:func:`chunkjax.budget.parse_budget`, the one
    parser; ``"auto"`` is refused in one line: the drop-in does not see the loop's own device memory)."""
    from chunkjax.budget import parse_budget
    return parse_budget(device_budget, takes=("min",), api="the drop-in optimizer")


def host_spec(tx):
    """``tx`` if it is a host kernel spec (AdamW / Lion / SGDMomentum of chunkjax.kernels), else None."""
    if isinstance(tx, optax.GradientTransformation):
        return None
    from chunkjax.kernels import AdamW, Lion, SGDMomentum  # numba: loaded only when a spec is given
    if isinstance(tx, (AdamW, Lion, SGDMomentum)):
        return tx
    raise TypeError(_MSG_TX.format(type=type(tx).__name__) + optim.wrapper_hint(tx, micro_batches=False))


def _path_names(tree) -> list[str]:
    return [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def structure_error(layout: ChunkLayout, grads) -> str:
    """One line naming the first leaf that ``grads`` lacks or has too many."""
    want = [s.path for s in layout.slots]
    try:
        got = _path_names(grads)
    except Exception:  # noqa: BLE001 - not a pytree jax can flatten
        return f"{type(grads).__name__} is not a pytree of {len(want)} leaves"
    missing = [p for p in want if p not in set(got)]
    extra = [p for p in got if p not in set(want)]
    if missing:
        return f"leaf {missing[0]!r} is missing" + (f" (got {extra[0]!r} instead)" if extra else "")
    if extra:
        return f"leaf {extra[0]!r} is not a param"
    return f"{len(got)} leaves where the params have {len(want)} (other containers)"


# ---- the drop-in's programs and placement ---------------------------------------------------------

def sub_layout(layout: ChunkLayout, c: int) -> tuple[ChunkLayout, tuple[tuple[int, Piece], ...]]:
    """Chunk ``c`` as a one-chunk layout over the list of its leaf pieces (offset order), and the
    ``(slot index, piece)`` pairs (:meth:`ChunkLayout.chunk_pieces`). A piece holding a whole leaf
    keeps the leaf's shape; a piece of a leaf spanning chunks is a flat ``(size,)`` leaf. Paths are
    dropped so that chunks holding the same shapes at the same offsets (e.g. repeated blocks)
    compare equal and share compiled programs."""
    pieces = layout.chunk_pieces(c)
    slots = tuple(LeafSlot(path=str(k), pieces=(Piece(0, p.offset, 0, p.size),),
                           shape=layout.slots[i].shape if whole(layout, i, p) else (p.size,),
                           dtype=layout.slots[i].dtype) for k, (i, p) in enumerate(pieces))
    sub = ChunkLayout(treedef=jax.tree.structure([0] * len(pieces)), slots=slots, chunk_size=layout.chunk_size,
                      chunk_dtypes=(layout.chunk_dtypes[c],), chunk_trainable=(layout.chunk_trainable[c],))
    return sub, pieces


def whole(layout: ChunkLayout, i: int, p: Piece) -> bool:
    """Piece ``p`` is all of leaf ``i``."""
    return p.size == layout.slots[i].size


def piece_of(layout: ChunkLayout, leaves, i: int, p: Piece):
    """Leaf ``i`` of ``leaves`` as :func:`sub_layout` takes it: whole, or its flat piece ``p``."""
    return leaves[i] if whole(layout, i, p) else jax.lax.slice(jnp.ravel(leaves[i]), (p.leaf_offset,),
                                                                (p.leaf_offset + p.size,))


def cuts_of(layout: ChunkLayout, c: int) -> tuple:
    """Per piece of chunk ``c`` (:meth:`ChunkLayout.chunk_pieces`): None for a whole leaf, else
    ``(leaf_offset, size)`` of its flat run (a leaf spanning chunks)."""
    return tuple(None if whole(layout, i, p) else (p.leaf_offset, p.size) for i, p in layout.chunk_pieces(c))


def cut(x, where):
    """``x`` itself (``where`` None) or its flat run ``where = (leaf_offset, size)`` (inside a
    program: fused into the consumer, nothing materialised)."""
    if where is None:
        return x
    off, n = where
    return jax.lax.slice(jnp.ravel(x), (off,), (off + n,))


def program_key(layout: ChunkLayout, c: int) -> tuple:
    """What chunk ``c``'s update programs are compiled for: its :func:`sub_layout` and, per piece,
    None (a whole leaf) or the size of its flat run. The runs' leaf offsets are arguments
    (:func:`chunk_ids`), not constants: the chunks inside one leaf that spans many (an embedding,
    or any leaf at a small chunk size) share one program instead of compiling one each."""
    return sub_layout(layout, c)[0], tuple(None if w is None else w[1] for w in cuts_of(layout, c))


def chunk_ids(layout: ChunkLayout, c: int) -> np.ndarray:
    """The ``c`` argument of chunk ``c``'s update programs (:class:`ChunkPrograms`): (1 + pieces,)
    int32, the chunk's index, then each piece's leaf offset (0 for a whole leaf)."""
    return np.asarray([c] + [0 if w is None else w[0] for w in cuts_of(layout, c)], np.int32)


def cut_at(x, size, off):
    """``x`` itself (``size`` None) or its flat run of ``size`` elements from ``off`` (a traced
    int32: one program for every offset; fused into the consumer, nothing materialised)."""
    return x if size is None else jax.lax.dynamic_slice_in_dim(jnp.ravel(x), off, size)


@dataclasses.dataclass(frozen=True)
class ChunkPrograms:
    """The jitted programs of one chunk shape (one :func:`program_key`: its :func:`sub_layout` and
    its pieces' run sizes, ``sizes``; the runs' leaf offsets come with the chunk index,
    :func:`chunk_ids`)."""

    sub: ChunkLayout
    tx: Any
    sizes: tuple = ()

    @property
    def update(self):
        """``(grad leaves, master, state, grad_sq, ids) -> (new param leaves, master, state)``, all on
        the device, master and state donated (device-resident chunks, and streamed chunks once
        fetched); ``ids``: the chunk's :func:`chunk_ids`. The grad leaves are the whole leaves of
        the chunk's pieces (a leaf spanning chunks is cut inside the program: no copy of its piece
        exists outside it)."""
        dev = sharding(DEVICE)
        sub, tx, sizes = self.sub, self.tx, self.sizes or (None,) * len(self.sub.slots)
        dt = sub.chunk_dtypes[0]

        def upd(grad_leaves, master, state, grad_sq, ids):
            g = sub.pack([cut_at(x, n, ids[1 + k]) for k, (x, n) in enumerate(zip(grad_leaves, sizes))],
                         dtype=optim.MASTER_DTYPE)[0]
            o = optim.update_chunk(tx, g, master, state, jnp.sum(grad_sq), grad_sq[ids[0]], dt)
            return tuple(sub.unpack([o.params])), o.master, o.opt_state

        return jax.jit(upd, in_shardings=(dev, dev, dev, dev, dev), out_shardings=(dev, dev, dev),
                       donate_argnums=(1, 2))

    @property
    def update_lean(self):
        """A float32 chunk's update without its master in the state that moves:
        ``(grad leaves, param leaves, state, grad_sq, c) -> (new param leaves, state)``, state
        donated. The master is packed inside the program from the params the optimizer returned
        last (for float32 params they are the master, bit for bit: :func:`lean_chunks`), so a
        streamed chunk moves its optimizer state only (8 of AdamW's 12 bytes per param each way)."""
        dev = sharding(DEVICE)
        sub, tx, sizes = self.sub, self.tx, self.sizes or (None,) * len(self.sub.slots)
        dt = sub.chunk_dtypes[0]

        def upd(grad_leaves, param_leaves, state, grad_sq, ids):
            g = sub.pack([cut_at(x, n, ids[1 + k]) for k, (x, n) in enumerate(zip(grad_leaves, sizes))],
                         dtype=optim.MASTER_DTYPE)[0]
            master = sub.pack([cut_at(x, n, ids[1 + k]) for k, (x, n) in enumerate(zip(param_leaves, sizes))],
                              dtype=optim.MASTER_DTYPE)[0]
            o = optim.update_chunk(tx, g, master, state, jnp.sum(grad_sq), grad_sq[ids[0]], dt)
            return tuple(sub.unpack([o.params])), o.opt_state

        return jax.jit(upd, in_shardings=(dev, dev, dev, dev, dev), out_shardings=(dev, dev), donate_argnums=(2,))

    @property
    def unpack(self):
        """``(chunk_size,)`` params chunk on the device -> ``(its param leaves, done)``; ``done`` is
        ``p[:1]``, an array of one element that is ready once this program (and so the transfer
        that made ``p``) is done: a host chunk's pinned params buffer may be rewritten after it,
        and the chunk ``p`` itself need not be kept for that (a second device copy of the host
        chunks' params between updates)."""
        sub, dev = self.sub, sharding(DEVICE)
        return jax.jit(lambda p: (tuple(sub.unpack([p])), p[:1]), in_shardings=dev, out_shardings=dev)


# ---- the host chunks' gradients: what goes to the host, and the kernel over it -------------------

#: Gradient dtypes the host kernel reads as they are (anything else is cast to float32 on the device).
HOST_GRAD_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16))


class HostSends(NamedTuple):
    """How the host chunks' gradients reach the host (:func:`host_sends`), without packing on
    the device: a leaf whose every piece is in host chunks goes whole, with the first of them
    (a later chunk reads its piece from that copy); a piece of a leaf that also has a piece in
    a device or streamed chunk is cut on the device first (:attr:`cut`).

    Attributes:
      whole: per host chunk, the slot indices of the leaves sent with it.
      cut: ``(chunk, piece index)`` of the pieces cut on the device.
      last: ``("leaf", slot) / ("piece", (chunk, k))`` -> the last host chunk that reads it.
    """

    whole: dict
    cut: frozenset
    last: dict


def host_sends(layout: ChunkLayout, host: Sequence[int]) -> HostSends:
    """The :class:`HostSends` of the host chunks ``host`` (in their update order)."""
    on_host = set(host)
    holders: dict[int, set] = {}
    for c in range(layout.n_chunks):
        for i, _ in layout.chunk_pieces(c):
            holders.setdefault(i, set()).add(c)
    whole, cuts, last, sent = {c: [] for c in host}, set(), {}, set()
    for c in host:
        for k, (i, _) in enumerate(layout.chunk_pieces(c)):
            if holders[i] <= on_host:
                if i not in sent:
                    whole[c].append(i)
                    sent.add(i)
                last[("leaf", i)] = c
            else:
                cuts.add((c, k))
                last[("piece", (c, k))] = c
    return HostSends({c: tuple(v) for c, v in whole.items()}, frozenset(cuts), last)


def prepare_grads(layout: ChunkLayout, sends: HostSends, grad_leaves):
    """One program over the user's gradient leaves (the optimizer jits it): the (n_chunks,) f32
    squared norms of each chunk's gradient pieces (cut inside the program: nothing
    materialised), and what the host chunks need beside the leaves themselves: ``{(chunk, k):
    piece}`` of the pieces cut on the device (:attr:`HostSends.cut`) and ``{slot: float32
    leaf}`` of host leaves whose dtype the kernel does not read (:data:`HOST_GRAD_DTYPES`)."""
    f32 = jnp.float32
    readable = lambda x: x if np.dtype(x.dtype) in HOST_GRAD_DTYPES else x.astype(f32)  # noqa: E731
    sq = [sum((jnp.sum(jnp.square(cut(grad_leaves[i], w).astype(f32)))
               for (i, _), w in zip(layout.chunk_pieces(c), cuts_of(layout, c))), jnp.zeros((), f32))
          for c in range(layout.n_chunks)]
    pieces = {(c, k): readable(piece_of(layout, grad_leaves, *layout.chunk_pieces(c)[k])) for c, k in sends.cut}
    cast = {i: grad_leaves[i].astype(f32) for idx in sends.whole.values() for i in idx
            if np.dtype(grad_leaves[i].dtype) not in HOST_GRAD_DTYPES}
    return jnp.stack(sq), pieces, cast


#: A host chunk's pieces below this many elements are gathered into one run per stretch of
#: neighbours (one kernel launch for a chunk's biases and norms, not one each).
SMALL_PIECE = 1 << 16


def host_runs(pieces, grads) -> list[tuple[int, int, np.ndarray]]:
    """``(lo, hi, gradient)`` runs of one host chunk: each piece of at least :data:`SMALL_PIECE`
    elements on its own (its gradient as it landed), consecutive smaller pieces gathered into one
    float32 run over their offsets (zeros in any gap between them: padding, which a step keeps
    zero). ``pieces``: ``(slot, piece)`` pairs in offset order; ``grads``: per piece its (size,)
    gradient."""
    runs, group = [], []

    def flush():
        if group:
            lo, hi = group[0][0].offset, group[-1][0].offset + group[-1][0].size
            g = np.zeros(hi - lo, np.float32)
            for p, x in group:
                g[p.offset - lo:p.offset - lo + p.size] = x
            runs.append((lo, hi, g))
            group.clear()
    for (_, p), g in zip(pieces, grads):
        if p.size >= SMALL_PIECE:
            flush()
            runs.append((p.offset, p.offset + p.size, g))
        else:
            group.append((p, g))
    flush()
    return runs


def warm_host_kernels(spec, chunk_dtypes) -> None:
    """Compile (or load from numba's cache) on the calling thread every kernel variant that
    :func:`host_chunk_step` may launch for chunks of these dtypes: a run of one block and one of
    :data:`SMALL_PIECE` elements, float32 and bf16-bits gradients, the params written as bf16
    bits or not. numba's LLVM must not compile while XLA compiles on another thread (the process
    aborts: ``gpu_facts.md``), and the first update compiles XLA programs beside the kernel thread."""
    from chunkjax.kernels import step_hyper, update_
    hyper = step_hyper(spec, 0, np.float32(0.0))
    for dt in {np.dtype(d) for d in chunk_dtypes}:
        for n in (1, SMALL_PIECE):
            st = spec.host_state(n)
            moments = tuple(getattr(st, f.name) for f in dataclasses.fields(st) if f.name != "count")
            for g in (np.zeros(n, np.float32), np.zeros(n, np.uint16)):
                update_(hyper, np.zeros(n, np.float32), moments, g, np.zeros(n, np.uint16) if dt == jnp.bfloat16
                        else None, 1.0)


#: Cores the host kernel leaves to the other threads of an update: the up and down transfer
#: threads, the caller dispatching the streamed updates, and the runtime's own (docs/dropin.md,
#: "Threads": a hypothesis from the s14 run, to be measured with ``--sweep-threads``).
TRANSFER_CORES = 4


def host_buffers(master: np.ndarray, dtype) -> tuple[np.ndarray, jax.Array]:
    """A host chunk's float32 master (numpy) and its pinned params buffer (compute dtype). For
    float32 params one pinned buffer is both: the kernel updates it in place and it goes to the
    device as it is (no copy on the host). The buffer is chunkjax's alone (read by eager
    transfers only; gpu_facts.md, "Rules for updating pinned buffers in place on the host").

    Args:
      master: (chunk_size,) float32 master params of the chunk (numpy or a host array).
      dtype: the chunk's compute dtype (float32 / bfloat16 / float16).

    Returns:
      ``(master, params)``: a (chunk_size,) float32 numpy array the kernel updates in place and
      the (chunk_size,) ``dtype`` pinned_host jax.Array the new params leave from (for float32
      the first is a writable view of the second).
    """
    p = jax.device_put(np.asarray(master, np.float32).astype(dtype), sharding(PINNED_HOST), may_alias=False)
    if np.dtype(dtype) == np.float32:
        from chunkjax.host_update import writable_view
        return writable_view(p, np.float32), p
    return np.array(master, np.float32), p


def host_threads_for(host_threads: int | None) -> int:
    """The host kernel's numba threads: ``host_threads``, or by default this process's cores less
    :data:`TRANSFER_CORES` (at least 1), at most numba's pool (``NUMBA_NUM_THREADS``).

    Raises:
      ValueError: ``host_threads`` not an int in ``[1, NUMBA_NUM_THREADS]``.
    """
    import os

    import numba
    top = numba.config.NUMBA_NUM_THREADS
    if host_threads is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(top, cores - TRANSFER_CORES))
    if isinstance(host_threads, bool) or not isinstance(host_threads, int) or not 1 <= host_threads <= top:
        raise ValueError(f"host_threads={host_threads!r}: use an int in [1, {top}] (numba's threads, "
                         "NUMBA_NUM_THREADS) or None for the cores less the transfer threads")
    return host_threads


def host_chunk_step(spec, state, master: np.ndarray, params, pieces, grads, scale,
                    threads: int | None = None) -> None:
    """One host chunk's optimizer step in place, run by run (:func:`host_runs`; the kernel of
    :func:`chunkjax.kernels.update_` on each run of the chunk's master, moments and, for bf16
    params, params buffer): element for element the chunk's step (the kernel is elementwise;
    padding holds zeros that a step keeps zero). The step's scalars are computed once and the
    count advances once.

    Args:
      spec: the host kernel spec. state: the chunk's ``Host*State`` (moments (chunk_size,)).
      master: (chunk_size,) float32 master params (for float32 params: the pinned params buffer).
      params: the chunk's pinned params buffer (a jax array; written for non-float32 params).
      pieces: the chunk's ``(slot index, piece)`` pairs. grads: per piece its (size,) gradient
        (numpy float32 or bfloat16, read only).
      scale: the gradient factor (``1.0`` or :func:`chunkjax.kernels.clip_scale`'s pair).
      threads: numba threads of the calling thread's kernels (None: as they are); numba's count is
        per calling thread, so this sets the kernel thread's alone.
    """
    from chunkjax import host_update as hu
    from chunkjax.kernels import next_count, step_hyper, update_
    dt = np.dtype(params.dtype)
    bits = hu.writable_view(params, np.uint16) if dt == jnp.bfloat16 else None
    moments = [getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "count"]
    if threads is not None:
        import numba
        numba.set_num_threads(threads)
    count = int(state.count)
    hyper = step_hyper(spec, count, hu.learning_rate_at(spec.learning_rate, count))
    for lo, hi, g in host_runs(pieces, grads):
        g = g.view(np.uint16) if g.dtype == jnp.bfloat16 else g
        update_(hyper, master[lo:hi], tuple(m[lo:hi] for m in moments), g, None if bits is None else bits[lo:hi], scale)
    state.count = next_count(count)
    if dt not in HOST_GRAD_DTYPES:  # (float32: the master is the params buffer; bf16: written above)
        np.copyto(hu.writable_view(params, dt), master.astype(dt))


def place(lay: ChunkLayout, cb, budget: int, depth: int, split, host_reserve: int = 0):
    """The optimizer_only placement with room for ``depth`` streamed chunks on the device: the
    deepest pipeline (<= ``depth``) whose reserve still leaves the update's working set in the
    budget; no reserve when no chunk is streamed. ``host_reserve`` bytes are kept free for the
    host chunks' new params on their way to the device. Returns (plan, depth, streamed, host)."""
    for d in range(depth, 0, -1):
        try:
            plan = plan_schedule(lay, (), cb, budget - (d - 1) * cb.state - host_reserve, policy="optimizer_only")
        except PlanError:
            if d == 1:
                raise
            continue
        offloaded = [c for c, k in enumerate(plan.placement.state_kinds) if k == PINNED_HOST]
        streamed, host = split(offloaded, d)
        if d == 1 or len(streamed) > 1:
            return plan, (min(d, len(streamed)) if streamed else 1), streamed, host
    raise AssertionError("unreachable: depth 1 returns or raises")


class DropinPlan(NamedTuple):
    """Where the drop-in optimizer updates each chunk (:func:`choose`).

    Attributes:
      placement: a :class:`chunkjax.Placement` (params on the device; state device / pinned host).
      depth: the streamed pipeline's depth.
      streamed, host: offloaded chunk ids updated through the device and by the host kernel.
      in_flight: host chunks' new params chunks on the device at once on their way from the host
        (0-2; their gradients go to the host from the user's gradient leaves: no device copy).
      working_bytes: device bytes of the update's transients (one chunk's update working set when
        any chunk updates on the device, the pipeline's extra chunks, the host params in flight).
      device_state_bytes, host_state_bytes: master + optimizer state bytes on / off the device.
      predicted_s: :func:`predict_update_s` of the offloaded chunks.
    """

    placement: Any
    depth: int
    streamed: tuple
    host: tuple
    in_flight: int
    working_bytes: int
    device_state_bytes: int
    host_state_bytes: int
    predicted_s: float


def smallest_budget(lay: ChunkLayout, cb, depth: int, host: bool, host_chunks: int | None, rates: Rates | None,
                    lean: bool = False) -> int:
    """The least device budget (bytes) for which :func:`choose` finds a plan of ``lay``'s chunks
    (a drop-in's ``device_budget="min"``): the smallest of the plans' own minimums (the
    streamed pipeline's, :class:`chunkjax.PlanError` ``.min_budget_bytes``; with a host spec and
    an automatic split, one params chunk in flight for the all-host plan)."""
    try:
        choose(lay, cb, 1, depth, host, host_chunks, rates, lean)
        return 1
    except PlanError as e:
        need = e.min_budget_bytes
    if host and host_chunks in (None, lay.n_chunks):
        need = min(need, cb.params) if need else cb.params
    return int(need)


def choose(lay: ChunkLayout, cb, budget: int, depth: int, host: bool, host_chunks: int | None,
           rates: Rates | None, lean: bool = False) -> DropinPlan:
    """The drop-in's plan: the ``"optimizer_only"`` placement (:func:`place`) with the offloaded
    chunks split between the streamed pipeline and, if ``host``, the host kernel, with two or one
    host params chunks in flight where the budget has room; with an automatic split
    (``host_chunks=None``) also the plan that updates every chunk on the host kernel (no device
    update working set at all: it fits budgets below one chunk's update), the faster predicted
    one wins. ``lean``: float32 streamed chunks move their optimizer state only (:func:`lean_chunks`).

    Raises:
      chunkjax.PlanError: no plan fits ``budget`` (or ``host_chunks`` cannot be honoured).
      ValueError: ``host_chunks`` out of range.
    """
    rates = rates or DEFAULT_RATES
    n = lay.n_chunks
    moved = streamed_bytes(lay, cb, lean)
    tries = ([(2, host_chunks), (1, host_chunks)] + ([(0, 0)] if not host_chunks else [])) if host else [(0, 0)]
    found, error = [], None
    for in_flight, n_host in tries:
        def split(offloaded, d, n_host=n_host):  # n_host None: by rate
            if n_host == 0:
                return tuple(offloaded), ()
            return split_offloaded(offloaded, lay.chunk_size, cb.state, cb.grad, cb.params, rates, n_host, d, moved)
        try:
            plan, d, streamed, on_host = place(lay, cb, budget, depth, split, in_flight * cb.params)
        except PlanError as e:
            error = error or e
            continue
        in_flight = in_flight if on_host else 0
        found.append(DropinPlan(
            plan.placement, d, streamed, on_host, in_flight,
            int(plan.predicted.peak_device_bytes - plan.predicted.device_model_bytes + (d - 1) * cb.state
                + in_flight * cb.params),
            int(plan.predicted.device_model_bytes), int(plan.predicted.host_model_bytes),
            predict_update_s(len(streamed), len(on_host), lay.chunk_size, cb.state, cb.grad, cb.params, rates, d,
                             moved)))
        break
    if host and host_chunks in (None, n):
        for in_flight in (2, 1):  # every chunk on the host kernel: only params chunks on their way back
            working = in_flight * cb.params
            if working <= budget:
                from chunkjax.schedule import Placement
                found.append(DropinPlan(
                    Placement.uniform(n, DEVICE, PINNED_HOST), 1, (), tuple(range(n)), in_flight, working, 0,
                    n * cb.state, predict_update_s(0, n, lay.chunk_size, cb.state, cb.grad, cb.params, rates, 1)))
                break
    if not found:
        raise error
    return min(found, key=lambda p: p.predicted_s)
