"""What a chunked step costs, read from the step and the compiler (no run): compiled memory of
its programs, pinned host bytes of its state, collective bytes per rank and device bytes held.

Every figure is in bytes. ``*_accounted`` figures of the reports come from here; the compiler's
memory analysis is what XLA reports for the programs that will run (definitions.md).
"""
from __future__ import annotations

import concurrent.futures
import os
from typing import Any

import jax
import numpy as np

from chunkjax import optim
from chunkjax.memory import DEVICE, PINNED_HOST, sharding
from chunkjax.remat import kept_kinds

_MEM_FIELDS = ("argument", "output", "temp", "alias", "host_argument", "host_output", "host_temp")


def _memory(compiled) -> dict:
    """The compiled program's memory analysis (bytes) and its device peak."""
    ma = compiled.memory_analysis()
    d = {f: int(getattr(ma, f"{f}_size_in_bytes", 0) or 0) for f in _MEM_FIELDS}
    d["peak_device_bytes"] = d["argument"] + d["output"] + d["temp"] - d["alias"]
    return d


def compiled_memory(step, batch) -> dict:
    """Compiler's memory analysis of ``step.jit_fwd_bwd`` (the whole step as one program) for a
    batch shape, in bytes:
    ``argument``, ``output``, ``temp``, ``alias`` and ``host_*`` where the runtime reports
    them, plus ``peak_device_bytes`` = argument + output + temp - alias."""
    topo = step.topology
    args = (tuple(jax.ShapeDtypeStruct((step.layout.chunk_size,), param_dtype(step, c), sharding=topo.param_sharding(k))
                  for c, k in enumerate(step.placement.param_kinds)),
            jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=topo.batch_sharding()), batch))
    return _memory(step.jit_fwd_bwd.lower(*args).compile())


def compiled_programs(step, batch, workers: int | None = None) -> list:
    """Every program of the pipelined step compiled for a (global) batch shape, in order
    (``jax.stages.Compiled``), with the arguments the step runs it with: param chunks in their
    memory kinds, the batch placed, the carry of program k program k-1's output (with loss
    scaling the first one's holds the scale), the step's donation. Each is kept by the step
    (:meth:`chunkjax.step.ChunkedStep.runnable`) and runs there, so the compiled check
    and the step's first call compile every program once (a ``ShapeDtypeStruct`` of a
    ``pinned_host`` single-device sharding lowers with a device-memory aval, so jit alone
    would trace, lower and compile it again for the step's pinned arrays).

    On one device every carried value (activations, held chunks, accumulators) leaves a program
    in device memory, so the programs are lowered in order and compiled by ``workers`` threads at
    once (XLA compiles with the GIL released; default: half the host's cores, at most 8). On a
    mesh the carry's shardings are the compiler's choice: each program is compiled before the
    next is lowered. ``workers=1`` compiles in order everywhere."""
    topo = step.topology
    carry = {"loss_scale": jax.ShapeDtypeStruct((), np.float32)} if step.loss_scaling else {}
    ab = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=topo.batch_sharding()), batch)
    single = step.mesh is None
    workers = max(1, min(8, (os.cpu_count() or 2) // 2)) if workers is None else max(1, int(workers))
    on_device = sharding(DEVICE, next(iter(topo.batch_sharding().device_set))) if single else None
    pool = concurrent.futures.ThreadPoolExecutor(workers) if single and workers > 1 else None
    pending = []
    try:
        for k in range(len(step.program_bounds())):
            fn, args = step.program(batch, k)
            params = {c: jax.ShapeDtypeStruct((step.layout.chunk_size,), param_dtype(step, c),
                                              sharding=topo.param_sharding(step.placement.param_kinds[c])) for c in args}
            acc = carry.pop("acc", {})
            lowered = fn.lower(params, ab, carry, acc)
            res = jax.eval_shape(fn, params, ab, carry, acc)
            if pool is not None:
                pending.append(pool.submit(lowered.compile))
                osh = jax.tree.map(lambda _: on_device, (res[0], res[1]))
                kinds = kept_kinds(getattr(step.schedule, "remat", ()), step.moments, step.program_bounds()[k][1])
                for part, kk in kinds.items():  # kept activations leave in their kinds (chunkjax.remat)
                    osh[0][part] = {q: [sharding(kk[q], next(iter(on_device.device_set))) for _ in v]
                                    for q, v in res[0][part].items()}
            else:
                pending.append(lowered.compile())
                osh = pending[-1].output_shardings
            carry = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                                 dict(res[0], acc=res[1]), dict(osh[0], acc=osh[1]))
        out = [p.result() if pool is not None else p for p in pending]
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    on_host = sharding(PINNED_HOST, next(iter(on_device.device_set))) if single else None
    if pool is not None and any(_carry_shardings(c) - {on_device, on_host} for c in out[:-1]):
        return compiled_programs(step, batch, workers=1)  # a carry left device memory: in order
    for k, compiled in enumerate(out):
        step.runnable(batch, k, compiled)
    return out


def _carry_shardings(compiled) -> set:
    """The shardings of a compiled program's carried outputs (the carry and the accumulators)."""
    osh = compiled.output_shardings
    return set(jax.tree.leaves((osh[0], osh[1])))


def compiled_memory_programs(step, batch) -> list[dict]:
    """Memory analysis of every program of the pipelined step (bytes), in order
    (:func:`compiled_programs`: the executables the step then runs)."""
    return [_memory(c) for c in compiled_programs(step, batch)]


def param_dtype(step, c: int):
    """The dtype of chunk ``c``'s params in the state: float32 for a master-fetch chunk (its
    master params), a frozen chunk's own dtype, else the compute dtype."""
    if c in step.master_fetch_chunks:
        return np.dtype(np.float32)
    return np.dtype(step.layout.chunk_dtypes[c]) if c in step.frozen_chunks else np.dtype(step.compute_dtype)


def host_grad_window_bytes(step) -> int:
    """Bytes of host-updated chunks' gradients that exist at once in ``pinned_host`` memory (one
    micro-batch, the host thread keeping up or held back by
    :meth:`chunkjax.updaters.HostWork.hand_over`): the most over
    ``grad_window`` consecutive programs of the step (``Schedule.grad_window``,
    :func:`chunkjax.predict.grad_window_bytes`)."""
    from chunkjax.predict import grad_window_bytes
    done_at = {s: t for t, (ph, s) in enumerate(step.moments) if ph != "forward"}
    host = set(step.host_chunks)
    done = [done_at[s] for c, s in step.first_reader.items() if c in host]
    starts = [a for a, _ in step.program_bounds()]
    return grad_window_bytes(done, starts, step.layout.chunk_size * np.dtype(step.compute_dtype).itemsize,
                             step.grad_window)


def pinned_host_bytes(step) -> int:
    """Bytes this step's state and gradients keep in ``pinned_host`` memory (whole chunks):
    compute params and gradient chunks in that kind, master params and optimizer state kept
    there (streamed chunks). Host-updated chunks: their compute copy, or for a master-fetch chunk
    its float32 master params; their gradients only as the working set
    (:func:`host_grad_window_bytes`); their optimizer state (and the copy-keeping chunks' master
    params) are pageable numpy arrays and do not count."""
    cs, it = step.layout.chunk_size, np.dtype(step.compute_dtype).itemsize
    opt = optim.state_bytes_per_chunk(step.tx, cs)
    host, n = set(step.host_chunks), 0
    for c in range(step.layout.n_chunks):
        if c in step.frozen_chunks:  # params only, in their own dtype
            n += step.layout.chunk_bytes(c) * (step.placement.param_kinds[c] == PINNED_HOST)
            continue
        if c in host:
            n += cs * param_dtype(step, c).itemsize
            continue
        if step.location(c) == "storage":  # compute params and gradient; master params and state on disk
            n += 2 * cs * it
            continue
        n += cs * it * (step.placement.param_kinds[c] == PINNED_HOST)
        n += cs * it * (step.placement.grad_kind(c) == PINNED_HOST)
        n += (4 * cs + opt) * (step.placement.state_kinds[c] == PINNED_HOST)
    return int(n + (host_grad_window_bytes(step) if host else 0))


def comm_bytes_per_step(step, batch) -> dict[str, int]:
    """Bytes one rank sends per step by collective, for ring algorithms (NCCL's for large
    messages): an all-gather or reduce-scatter of a C-byte chunk moves ``(N-1)/N * C`` per
    rank, an all-reduce ``2 (N-1)/N * C``; scalar reductions are left out (zero on one device).

    Stage 3 gathers a fetched chunk once per fetch and a device-resident chunk at every
    moment that reads it; stages 1/2 gather each device- or streamed-updated chunk's new
    params once (host-updated slices are written into every local replica on the host).
    Returns ``{"all_gather", "reduce_scatter", "all_reduce", "total"}`` in bytes.
    """
    n, lay = step.n_ranks, step.layout
    cbytes = lay.chunk_size * np.dtype(step.compute_dtype).itemsize
    part = lambda k: (k * (n - 1) * cbytes) // n  # noqa: E731
    if step.zero_stage == 3:
        walk = step.walk(step.local_batch(batch))
        gathers = sum(sum(1 for c in walk.reads_at(t) if step.placement.param_kinds[c] == DEVICE)
                      + len(walk.fetch[t]) for t in range(len(step.moments)))
    else:
        gathers = len(step.device_chunks) + len(step.streamed_chunks)
    graded = len(set(step.first_reader) - set(step.frozen_chunks))  # frozen chunks have no gradient
    out = {"all_gather": part(gathers), "reduce_scatter": part(graded) if step.zero_stage != 1 else 0,
           "all_reduce": 2 * part(graded) if step.zero_stage == 1 else 0}
    out["total"] = sum(out.values())
    return out


def device_bytes(step, state) -> dict[str, dict[Any, int]]:
    """Bytes each local device holds of the state's jax arrays, from ``addressable_shards``
    (every memory kind): ``{"params"|"master"|"opt_state": {device: bytes}}`` (host-updated
    numpy arrays are not device memory and are not counted)."""
    devices = list(step.mesh.devices.flat) if step.mesh is not None else [jax.devices()[0]]
    out = {}
    for name, tree in (("params", state.params), ("master", state.master), ("opt_state", state.opt_state)):
        per = {d: 0 for d in devices}
        for a in jax.tree.leaves(tree):
            if isinstance(a, jax.Array):
                for sh in a.addressable_shards:
                    per[sh.device] += sh.data.size * sh.data.dtype.itemsize
        out[name] = per
    return out
