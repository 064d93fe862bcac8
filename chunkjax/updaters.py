"""Per-location chunk updaters, shaped like optax's ``(init, update)`` pairs.

An update location (definitions.md) says where a chunk's optimizer step runs; each has one
updater here, written once for every topology (:mod:`chunkjax.topology` wraps the per-rank body
for a mesh):

* :func:`device_updater` for the two locations that update on the device: ``device`` (master
  params and optimizer state live on the device; one jitted program per param kind serves every
  chunk, the chunk id traced, master, state and the old compute params donated and updated in
  place) and ``streamed`` (``state_kind=PINNED_HOST``: the same programs; state kept in pinned host
  memory, moved to the device, updated there and moved back through a pipeline with both PCIe
  directions in flight, :mod:`chunkjax.streamed`, shared with the drop-in optimizers);
* :func:`host_updater`: float32 master params and optimizer state are numpy arrays updated in
  place by the host kernel (:mod:`chunkjax.host_update`) on a host thread, writing the new
  compute params straight into the pinned buffer (each rank's slice on a mesh);
* ``storage`` (:func:`chunkjax.storage.updater.storage_updater`): master params and optimizer
  state in chunk files, updated next to the disk by the near-storage workers (Smart-Infinity).

``init(buf, c) -> (master, opt_state)`` places one chunk's float32 master params ``buf``
((chunk_size,) numpy) and its fresh optimizer state; ``update`` performs one step. Both device
updaters run an unchanged elementwise optax transformation chunk by chunk
(:func:`chunkjax.optim.update_chunk`). :class:`~chunkjax.host_work.HostWork` (re-exported here) is the
host thread's pending work of one step, carried in the returned :class:`~chunkjax.step.TrainState`
(explicit state, no attributes written on the step).
"""
from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from chunkjax import optim
from chunkjax.cost import GRAD_WINDOW_PROGRAMS  # noqa: F401 (re-exported)
from chunkjax.host_work import (HOST_DEADLINE_MIN_S, HOST_DEADLINE_STEPS, HostDeadlineError,  # noqa: F401 (re-exported)
                                HostWork, host_deadline_s)
from chunkjax.memory import DEVICE, PINNED_HOST


class Updater(NamedTuple):
    """An update location's pair of functions (as optax's ``GradientTransformation``).

    Attributes:
      init: ``init(buf, c) -> (master, opt_state)``: chunk ``c``'s float32 master params
        (``buf``: (chunk_size,) numpy) and optimizer state, placed where this location keeps them.
      update: the step; for the device locations ``update(param_kind) -> jitted
        fn(grad, master, opt_state, grad_sq, c, old_params, inv_scale) -> (params, master,
        opt_state)``; for the host ``update(state, grads, grad_scale) -> seconds``.
    """

    init: Callable
    update: Callable


def chunk_body(tx, compute_dtype, skip: bool, loss_scaling: bool):
    """``body(grad, master, state, grad_sq_total, grad_sq_own, inv_scale) -> (params, master,
    state)``: one chunk's :func:`chunkjax.optim.update_chunk` (the device-side updaters' body)."""
    def body(grad, master, state, grad_sq_total, grad_sq_own, inv_scale):
        o = optim.update_chunk(tx, grad, master, state, grad_sq_total, grad_sq_own, compute_dtype, skip,
                               inv_scale if loss_scaling else None)
        return o.params, o.master, o.opt_state
    return body


def state_template(tx, chunk_size: int):
    """The abstract optax state of one chunk (``ShapeDtypeStruct`` leaves)."""
    return jax.eval_shape(lambda: optim.init_chunk_state(tx, jnp.zeros((chunk_size,), jnp.float32)))


def device_updater(topology, tx, chunk_size: int, compute_dtype, param_kinds, *, state_kind: str = DEVICE,
                   skip: bool = False, loss_scaling: bool = False, donate: bool = True) -> Updater:
    """The two update locations whose update runs on the device: ``device`` (master params and
    optimizer state live on the device and are updated in place) and ``streamed`` (they live in
    pinned host memory; :class:`chunkjax.streamed.StepStream` moves a chunk's to the device, runs
    the program and moves the results back). One program per compute-param kind in
    ``param_kinds`` serves every chunk (the chunk id is traced); one chunk per call keeps the
    update's float32 temporaries to one chunk (all chunks in one program let XLA schedule them at
    once). PatrickStar (arXiv 2108.05818) section 5, device-side update of a chunk.

    ``init(buf, c) -> (master, opt_state)``: chunk ``c``'s (chunk_size,) float32 master params
    and fresh optimizer state, in ``state_kind``. ``update(param_kind)``: the jitted
    ``fn(grad, master, opt_state, grad_sq, c, old_params, inv_scale) -> (params, master,
    opt_state)``, its inputs on the device (``grad`` (chunk_size,) compute dtype, ``grad_sq``
    (n_chunks,) float32 squared norms, ``c`` () int32, ``inv_scale`` () float32), master and state
    donated. The new compute params come out in ``param_kind`` for ``state_kind=DEVICE``, and on
    the device for ``PINNED_HOST`` (the write-back thread moves them: a transfer inside the
    program would hold the compute stream); ``old_params`` is donated to them where the two have
    one memory kind and is ignored otherwise (the streamed location passes None there).

    Args:
      topology: :class:`chunkjax.topology.SingleDevice` or :class:`~chunkjax.topology.DataMesh`.
      tx: an elementwise optax transformation.
      chunk_size: elements per chunk.
      compute_dtype: dtype of the new compute params.
      param_kinds: the compute-param memory kinds the programs serve.
      state_kind: ``DEVICE`` (update location ``device``) or ``PINNED_HOST`` (``streamed``).
      skip: a non-finite global norm leaves the chunk unchanged (``nonfinite="skip"``).
      loss_scaling: gradients and norms are unscaled by ``inv_scale``.
      donate: donate master, state and the old compute params.

    Raises:
      ValueError: ``state_kind`` is neither memory kind.
    """
    if state_kind not in (DEVICE, PINNED_HOST):
        raise ValueError(f"state_kind={state_kind!r}: use {DEVICE!r} (device updates) or {PINNED_HOST!r} (streamed)")
    template = state_template(tx, chunk_size)
    body = topology.per_rank_update(chunk_body(tx, compute_dtype, skip, loss_scaling), template)
    d, ssh_d, scalar = topology.shard_sharding(DEVICE), topology.state_shardings(template, DEVICE), \
        topology.scalar_sharding()

    def make(pk):
        psh = topology.param_sharding(pk if state_kind == DEVICE else DEVICE)  # the new params' kind
        reuse = state_kind == DEVICE or pk == DEVICE  # old params in that kind: donated to the new ones

        def upd(grad, master, state, grad_sq, c, old_params, inv_scale):
            del old_params  # donated: the new compute params reuse its buffer
            p, m, st = body(grad, master, state, grad_sq, c, inv_scale)
            return jax.device_put(p, psh), m, st

        # keep_unused: old_params is unused, and jit would prune it, dropping its donation (every
        # updated chunk would then hold two compute-param buffers until the step ends)
        return jax.jit(upd, in_shardings=(d, d, ssh_d, scalar, scalar, psh if reuse else None, scalar),
                       out_shardings=(psh, d, ssh_d), keep_unused=True,
                       donate_argnums=((1, 2, 5) if reuse else (1, 2)) if donate else ())

    programs = {pk: make(pk) for pk in set(param_kinds)}
    init_state = jax.jit(topology.per_rank_init(lambda m: optim.init_chunk_state(tx, m), template),
                         out_shardings=ssh_d)
    host = (topology.shard_sharding(PINNED_HOST), topology.state_shardings(template, PINNED_HOST))

    def init(buf, c):
        del c
        m = topology.put(np.asarray(buf, np.float32), d)
        st = init_state(m)
        return (m, st) if state_kind == DEVICE else (jax.device_put(m, host[0]), jax.device_put(st, host[1]))

    return Updater(init, programs.__getitem__)


def materialise_(arrays, reserve_bytes, what: str) -> None:
    """Make numpy buffers resident now: write each once (``fill(0)``; they are fresh zero state).
    ``np.zeros`` of a large array maps pages the kernel supplies only when first written, so
    without this a host chunk's optimizer state entered the process's RSS during the first step
    (issue 24: GPT3_15B on the H200 was killed there by the OOM killer, 76 GB of Adam m and v
    counted by the plan but absent from RSS before the step). Costs a page fault per 4 KiB page:
    about 2 GB/s per thread measured on a 2-core CPU VM (the rewrite of a resident page: 1.6 GB/s
    there), so the pieces of :data:`MATERIALISE_PIECE` elements are written by up to
    :data:`MATERIALISE_THREADS` threads (numpy releases the GIL while it fills).

    Args:
      arrays: numpy arrays, written whole (their content must be zeros: they are zeroed).
      reserve_bytes: host bytes the run still needs after its init
        (:func:`chunkjax.host_memory.init_reserve_bytes`); None: no check.
      what: what is made resident, for the error.

    Raises:
      chunkjax.HostMemoryError: ``MemAvailable`` would fall below ``reserve_bytes``; nothing of
        ``arrays`` was written (:func:`chunkjax.host_memory.check_materialise`).
    """
    from chunkjax.host_memory import check_materialise
    arrays = [a for a in arrays if a is not None and a.size]
    if reserve_bytes is not None:
        check_materialise(sum(a.nbytes for a in arrays), reserve_bytes, what)
    pieces = [a[i:i + MATERIALISE_PIECE] for a in arrays for i in range(0, a.size, MATERIALISE_PIECE)]
    workers = min(len(pieces), MATERIALISE_THREADS, os.cpu_count() or 1)
    if workers <= 1:
        for p in pieces:
            p.fill(0)
        return
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="chunkjax-materialise") as ex:
        list(ex.map(lambda p: p.fill(0), pieces))


#: Elements of one piece :func:`materialise_` writes on a thread (64 MiB of float32).
MATERIALISE_PIECE = 2**24
#: Threads :func:`materialise_` writes pieces with (at most the CPU count).
MATERIALISE_THREADS = 8


def host_updater(topology, host_optimizer, chunk_size: int, compute_dtype, master_fetch=(),
                 reserve_bytes=None) -> Updater:
    """Chunks updated in place on the host by the numba kernel of ``host_optimizer``
    (:class:`chunkjax.host_update.AdamW` / ``Lion`` / ``SGDMomentum``).

    ``init(buf, c)``: master params and host state as numpy; on a mesh a tuple over the ranks,
    one (chunk_size / N,) slice and one host state per rank of this process (``None`` for the
    ranks of other processes); the optimizer state is made resident (:func:`materialise_`), after
    checking that ``reserve_bytes`` (:func:`chunkjax.host_memory.init_reserve_bytes`; None: no
    check) stay available beside it. ``update(state, grads, grad_scale) -> seconds``: for each chunk of
    ``grads`` (``{c: gradient}``, a jax array or numpy) waits for the gradient, then runs the
    kernel on each local rank's shard, writing the new compute params into ``state.params[c]``'s
    buffer (stages 1/2: into that slice of every local replica); a chunk of ``master_fetch``
    (one device only) has no compute copy: its ``state.master[c]`` is a writable view of the
    float32 pinned buffer ``state.params[c]`` that the step's fetches read, and the kernel's
    update of the master params is all there is to write. Each gradient is popped from
    ``grads`` before its kernel runs, so no reference to a consumed gradient remains (the
    gradient working set, :func:`chunkjax.host_forms.grad_working_bytes`). ``grad_scale`` (a
    float, the clipping pair of :func:`chunkjax.kernels.clip_scale`, a callable returning one, or
    None for a skipped step) multiplies the gradients. Returns the kernel seconds (not the waits
    for gradients).

    Raises:
      ValueError: ``master_fetch`` chunks on a mesh.
      chunkjax.HostMemoryError (from ``init``): the host cannot hold a chunk's optimizer state
        and the reserve (one line, before the state is written).
    """
    from chunkjax import host_update as hu
    bf16 = jnp.dtype(compute_dtype) == jnp.bfloat16
    view_dt = np.uint16 if bf16 else np.dtype(compute_dtype)
    mesh = topology.mesh is not None
    fetch_master = frozenset(master_fetch)
    if mesh and fetch_master:
        raise ValueError("master_fetch chunks need one device: on a mesh host chunks keep their compute copy")

    def resident_state(n: int, c: int):
        st = host_optimizer.host_state(n)
        materialise_([getattr(st, f) for f in hu.moment_fields(st)], reserve_bytes, f"host chunk {c}'s optimizer state")
        return st

    def init(buf, c):
        buf = np.asarray(buf, np.float32)
        if not mesh:
            return buf, resident_state(chunk_size, c)
        local = set(topology.local_ranks())
        sl = [topology.rank_slice(r, chunk_size) for r in range(topology.n_ranks)]
        return (tuple(buf[s].copy() if r in local else None for r, s in enumerate(sl)),
                tuple(resident_state(chunk_size // topology.n_ranks, c) if r in local else None
                      for r in range(topology.n_ranks)))

    def update(state, grads: dict, grad_scale) -> float:
        if callable(grad_scale):
            grad_scale = grad_scale()
        if grad_scale is None:  # a skipped step (non-finite gradients): nothing changes
            grads.clear()
            return 0.0
        spent = 0.0
        while grads:
            c = next(iter(grads))
            g = grads.pop(c)  # the caller's dict no longer holds it: freed once the kernel is done
            wait_for_gradient(g)
            t0 = time.perf_counter()
            if c in fetch_master:
                g_np = np.asarray(g)
                g_np = g_np.view(np.uint16) if bf16 else g_np.astype(np.float32, copy=False)
                hu.host_update_(host_optimizer, state.opt_state[c], g_np, state.master[c], None, grad_scale)
                del g, g_np
                spent += time.perf_counter() - t0
                continue
            p_arr = state.params[c]
            for r, g_r in topology.grad_shards(g).items():
                g_np = np.asarray(g_r)
                outs = topology.param_views(p_arr, r, view_dt)
                master = state.master[c][r] if mesh else state.master[c]
                st = state.opt_state[c][r] if mesh else state.opt_state[c]
                if bf16:
                    hu.host_update_(host_optimizer, st, g_np.view(np.uint16), master, outs[0], grad_scale)
                elif view_dt == np.float32:  # the kernel writes the float32 copy in its one pass (a
                    # copy after it was a second, single-threaded pass: 20 ms per 51.4M-param chunk
                    # beside the kernel's 10 ms on the H200, s27b)
                    hu.host_update_(host_optimizer, st, g_np.astype(np.float32, copy=False), master, outs[0],
                                    grad_scale)
                else:
                    hu.host_update_(host_optimizer, st, g_np.astype(np.float32, copy=False), master, None, grad_scale)
                    # cast while copying (numpy's rounding, as astype): no temporary of the chunk's size
                    np.copyto(outs[0], master, casting="same_kind")
                for o in outs[1:]:  # stages 1/2: the other replicas get the same slice
                    np.copyto(o, outs[0])
            g = g_r = g_np = None  # drop the references before the next chunk
            spent += time.perf_counter() - t0
        return spent

    return Updater(init, update)


def wait_for_gradient(g) -> None:
    """Block the host thread until gradient ``g`` (a ``jax.Array`` leaving its program for pinned
    host memory, or numpy) is there: the host update's only wait for the device (its own
    function so that a profiler can time it: ``experiments/gpu_checks/front_door_3b.py``'s
    ``PhaseClock``)."""
    if isinstance(g, jax.Array):
        g.block_until_ready()


def host_write_params(topology, compute_dtype, master_fetch=()) -> Callable:
    """``write_params(state, c)``: rewrite host chunk ``c``'s compute params (its pinned buffer,
    each local rank's slice) as its float32 master params cast to ``compute_dtype`` (bf16: round
    to nearest even), what a skipped step leaves (:mod:`chunkjax.speculate`); nothing for a
    ``master_fetch`` chunk (its params are its master params)."""
    from chunkjax.kernels import bf16_round_bits
    bf16 = jnp.dtype(compute_dtype) == jnp.bfloat16
    view_dt = np.uint16 if bf16 else np.dtype(compute_dtype)
    mesh = topology.mesh is not None
    fetch_master = frozenset(master_fetch)

    def write_params(state, c: int) -> None:
        if c in fetch_master:
            return
        ranks = topology.local_ranks() if mesh else (0,)
        for r in ranks:
            master = state.master[c][r] if mesh else state.master[c]
            new = bf16_round_bits(master) if bf16 else master.astype(compute_dtype).view(view_dt)
            for o in topology.param_views(state.params[c], r, view_dt):
                np.copyto(o, new)

    return write_params


class HostInverter(NamedTuple):
    """Undo the host updater's last step of a chunk (:func:`host_inverter`)."""
    can: Callable  #: ``can(state, c) -> bool``: every local rank's last step is invertible
    finite: Callable  #: ``finite(g, grad_scale) -> bool``: every element of ``g * grad_scale`` squares finite
    invert: Callable  #: ``invert(state, c, g, grad_scale) -> None``: in place, count - 1, params untouched
    #: ``canonical(state, c, g, guess, right) -> None``: a chunk that did not speculate on a step whose factor
    #: ``right`` is not ``guess`` gets the bits of speculating, inverting and redoing (None: a skip, params untouched)
    canonical: Callable


def host_inverter(topology, host_optimizer, compute_dtype, master_fetch=()) -> HostInverter:
    """The inverse of :func:`host_updater`'s step on one chunk, each local rank's shard
    (:func:`chunkjax.host_update.host_invert_`; the gradient ``g`` as the updater took it, a jax
    array or numpy), for rollback by inversion (:mod:`chunkjax.speculate`). The compute params
    are left as they are: a redo's update rewrites them, :func:`host_write_params` a skip's."""
    from chunkjax import host_update as hu
    from chunkjax.kernels_inverse import gradient_finite
    bf16 = jnp.dtype(compute_dtype) == jnp.bfloat16
    view_dt = np.uint16 if bf16 else np.dtype(compute_dtype)
    mesh = topology.mesh is not None
    fetch_master = frozenset(master_fetch)

    def pairs(state, c):
        if not mesh:
            return [(0, state.master[c], state.opt_state[c])]
        return [(r, state.master[c][r], state.opt_state[c][r]) for r in topology.local_ranks()]

    def as_np(g):
        g = np.asarray(g)
        return g.view(np.uint16) if bf16 else g.astype(np.float32, copy=False)

    def can(state, c) -> bool:
        return all(hu.host_invertible(host_optimizer, st) for _, _, st in pairs(state, c))

    def finite(g, grad_scale) -> bool:
        return all(gradient_finite(as_np(g_r), grad_scale) for g_r in topology.grad_shards(g).values())

    def invert(state, c, g, grad_scale) -> None:
        g_of = {0: g} if c in fetch_master else topology.grad_shards(g)
        for r, master, st in pairs(state, c):
            hu.host_invert_(host_optimizer, st, as_np(g_of[r]), master, grad_scale)

    def canonical(state, c, g, guess, right) -> None:  # the params written as host_updater's update does
        g_of = {0: g} if c in fetch_master else topology.grad_shards(g)
        for r, master, st in pairs(state, c):
            if c in fetch_master or right is None:
                hu.host_canonical_(host_optimizer, st, as_np(g_of[r]), master, None, guess, right)
                continue
            outs = topology.param_views(state.params[c], r, view_dt)
            hu.host_canonical_(host_optimizer, st, as_np(g_of[r]), master, outs[0] if bf16 else None, guess, right)
            if not bf16:
                np.copyto(outs[0], master.astype(compute_dtype).view(outs[0].dtype))
            for o in outs[1:]:  # stages 1/2: the other replicas get the same slice
                np.copyto(o, outs[0])

    return HostInverter(can, finite, invert, canonical)


def pinned_master(topology, master: np.ndarray, copy: bool = True) -> tuple[jax.Array, np.ndarray]:
    """A master-fetch chunk's two names for one buffer: ``(params, master)``, its (chunk_size,)
    float32 master params placed in pinned host memory (what the step's fetches read and cast
    on the device) and a writable numpy view of that buffer (what the host kernel updates in
    place: gpu_facts.md, "Rules for updating pinned buffers in place"). One device only; host
    bytes: 4 per element, no compute copy. ``copy=False``: ``master`` is a fresh buffer the caller
    drops (the init's chunk buffer), put as it is (on a GPU the put copies it into the pinned pool;
    on the CPU the array may alias it); True: a copy is put, ``master`` stays the caller's."""
    from chunkjax import host_update as hu
    master = np.array(master, np.float32, copy=True) if copy else np.asarray(master, np.float32)
    p = topology.put(master, topology.param_sharding(PINNED_HOST))
    p.block_until_ready()
    return p, hu.writable_view(p, np.float32)


def warm_host_kernel(host_optimizer, compute_dtype) -> None:
    """Compile the host kernel for these dtypes on the calling thread: numba's LLVM must not
    compile while XLA compiles on another thread (the process aborts)."""
    from chunkjax import host_update as hu
    st = host_optimizer.host_state(1)
    master = np.zeros((1,), np.float32)
    if jnp.dtype(compute_dtype) == jnp.bfloat16:
        hu.host_update_(host_optimizer, st, np.zeros((1,), np.uint16), master, np.zeros((1,), np.uint16), 1.0)
    else:
        hu.host_update_(host_optimizer, st, np.zeros((1,), np.float32), master, None, 1.0)
