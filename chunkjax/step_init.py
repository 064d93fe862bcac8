"""The initial state of a chunked step: every chunk's master params, optimizer state and compute
params placed where its plan keeps them (:meth:`chunkjax.ChunkedStep.init`).

Issue 24 (setup time): GPT3_15B's init on the H200 filled 128 GB of host state at ~0.75 GB/s and
drew every leaf twice; GPT3_18B's waited ~50 s on its storage chunks' first writes. Here, with
the same state bit for bit (``tests/test_init_state.py``):

* one pass places each chunk's master params and optimizer state (its update location's
  :class:`~chunkjax.updaters.Updater`) and, where they do not live on the device, its compute
  params; a second pass builds only the chunks whose compute params live on the device (they are
  allocated after every temporary of the first pass is gone, so that resident chunks sit together
  on the device), so a master-fetch or storage chunk's leaves are drawn once;
* the storage chunks' master params go to their workers without waiting (one send in flight:
  :meth:`chunkjax.storage.near.NearStorageOptimizer.init_chunk`), spread among the host chunks of
  the first pass, so the workers' first writes run while the trainer fills host memory;
* chunk buffers are filled by threads (:meth:`chunkjax.layout.ChunkLayout.host_chunks`), and a
  master-fetch chunk's float32 buffer goes to pinned memory without another host copy.

Where the time goes, measured: docs/setup_time.md.
"""
from __future__ import annotations

import jax
import numpy as np

from chunkjax import updaters as upd
from chunkjax.host_memory import check_pinned_host
from chunkjax.memory import DEVICE, TransferWindow
from chunkjax.train_state import TrainState

#: Update locations whose init fills host memory (master params and optimizer state in numpy or
#: pinned buffers): the trainer's slow part, behind which the storage chunks' first writes run.
_HOST_FILLING = ("host", "streamed")


def first_pass_order(locations) -> list[int]:
    """The chunks in the order the first pass places them: every chunk once; the storage chunks in
    id order (their workers take them so) spread evenly among the chunks that fill host memory
    (``host``, ``streamed``; else among all others), so that each storage chunk's first write
    runs while the trainer fills the next chunks; the other chunks in id order.

    Args:
      locations: per chunk its update location (``"device"``, ``"host"``, ``"storage"``, ...).
    """
    n = len(locations)
    disk = [c for c in range(n) if locations[c] == "storage"]
    if not disk:
        return list(range(n))
    slow = [c for c in range(n) if locations[c] in _HOST_FILLING]
    if not slow:
        slow = [c for c in range(n) if locations[c] != "storage"]
    head = [c for c in range(n) if locations[c] != "storage" and c not in set(slow)]
    # merge by position in [0, 1): storage chunk k at k / len(disk), slow chunk j at (j + 0.5) / len(slow)
    keyed = [(k / len(disk), 0, c) for k, c in enumerate(disk)] + \
            [((j + 0.5) / len(slow), 1, c) for j, c in enumerate(slow)]
    return head + [c for _, _, c in sorted(keyed)]


def init_state(step, params) -> TrainState:
    """:meth:`chunkjax.ChunkedStep.init` of ``step``: see there for ``params`` and the errors. An
    init that fails after its storage chunks' workers started stops them before it raises."""
    lay = step.layout
    if step.mesh is None:  # the GPU runtime's pinned-host pool is capped (64 GiB by default)
        check_pinned_host(step.pinned_host_bytes(), jax.default_backend())
    leaf_at = params if callable(params) else (lambda i, _l=lay.treedef.flatten_up_to(params): _l[i])
    if step.host_chunks:
        upd.warm_host_kernel(step.host_optimizer, step.compute_dtype)

    n = lay.n_chunks
    frozen = set(step.frozen_chunks)  # params in their own dtype, no master or state
    dtypes = [lay.chunk_dtypes[c] if c in frozen else np.float32 for c in range(n)]
    kinds, topo, fetch_master = step.placement.param_kinds, step.topology, set(step.master_fetch_chunks)
    locations = [step.location(c) for c in range(n)]
    ms, os_, ps = [None] * n, [None] * n, {}
    window = TransferWindow()  # the runtime's host staging of pending copies stays at 2 chunks

    def params_of(c, buf):
        return window.add(topo.put(buf if c in frozen else buf.astype(step.compute_dtype),
                                   topo.param_sharding(kinds[c])))

    started = False  # a storage chunk's init ran: the workers are this init's
    try:
        order = first_pass_order(locations)
        for c, buf in zip(order, lay.host_chunks(leaf_at, dtypes, chunks=order)):
            later = {"wait": False} if locations[c] == "storage" else {}  # its file written while we go on
            started = started or bool(later)
            m, o = (None, None) if c in frozen else window.add(step.updaters[locations[c]].init(buf, c, **later))
            if c in fetch_master:  # the master params are the pinned params; master a view of them
                ps[c], m = upd.pinned_master(topo, m, copy=False)
            elif kinds[c] != DEVICE:  # compute params off the device: placed now, the leaves drawn once
                ps[c] = params_of(c, buf)
            ms[c], os_[c] = m, o
            del buf, m, o
        rest = [c for c in range(n) if c not in ps]  # device-resident compute params, after every temporary
        for c, buf in zip(rest, lay.host_chunks(leaf_at, dtypes, chunks=rest)):
            ps[c] = params_of(c, buf)
        ps = [ps[c] for c in range(n)]
        jax.block_until_ready((ps, [m for m in ms if isinstance(m, jax.Array)]))
        return TrainState(tuple(ps), tuple(ms), tuple(os_))
    except BaseException:  # the storage workers this init started end with it (no state holds them)
        if started:
            from chunkjax.storage.updater import close_storage
            close_storage(step)
        raise
