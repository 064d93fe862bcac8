"""Where :meth:`chunkjax.ChunkedStep.init` spends its time, part by part, on a host-resident model.

Issue 24: GPT3_15B's init on the H200 filled its 128 GB of host state at ~0.75 GB/s (170 s) and
GPT3_18B's took ~185 s, while three 18B steps need ~280 s of a 585 s call. This script plans a GPT
(default ~60 M params, ~1 GB of float32 state) with chunks of every kind a large plan has (device,
host master-fetch, host with a compute copy, storage), wraps the init's parts with timers (the
leaf draws, the chunk buffers' fill, each update location's ``init``, the master-fetch pinned put,
the compute params' puts) and prints seconds and GB/s per part, then writes JSON (``--out``)::

    JAX_PLATFORMS=cpu python experiments/init_profile.py --out /tmp/init_profile.json

Parts overlap (the storage chunks' first writes run in the workers while the trainer fills host
chunks), so they need not sum to the total. CPU only (memory kinds compile to nothing): the GPU's
figure is ``experiments/gpu_checks/init_speed.py``.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Timers:
    """Seconds and calls per named part (nested parts count in both)."""

    def __init__(self):
        self.s, self.n = collections.defaultdict(float), collections.defaultdict(int)

    def wrap(self, name, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.s[name] += time.perf_counter() - t0
                self.n[name] += 1
        return timed

    def wrap_iter(self, name, gen_fn):
        def timed(*a, **k):
            it = iter(gen_fn(*a, **k))
            while True:
                t0 = time.perf_counter()
                try:
                    x = next(it)
                except StopIteration:
                    self.s[name] += time.perf_counter() - t0
                    return
                self.s[name] += time.perf_counter() - t0
                self.n[name] += 1
                yield x
        return timed


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def build(a):
    """(step, leaf_at, layout, schedule) of a GPT planned with device, host and storage chunks."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import chunkjax as cj
    from chunkjax.host_update import AdamW
    from chunkjax.optim import state_bytes_per_chunk
    from chunkjax.plan import plan_schedule
    from chunkjax.storage.updater import StorageOptions
    from models import gpt

    spec = AdamW(1e-3, weight_decay=0.1)
    B, T = 2, 16
    cfg = gpt.get_config("micro", d_model=a.d_model, n_layers=a.layers, n_heads=4, vocab_size=a.vocab)
    abstract = jax.eval_shape(lambda: gpt.init_params(cfg, jax.random.key(0)))
    batch = jax.ShapeDtypeStruct((B, T + 1), jnp.int32)
    stages = gpt.gpt_stages(cfg)
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), abstract, batch)
    layout = cj.build_layout(abstract, a.chunk_size, order)
    traces = cj.trace_stages(stages, layout, batch, jnp.bfloat16)
    cb = cj.chunk_bytes(layout, jnp.bfloat16, state_bytes_per_chunk(spec.optax(), layout.chunk_size))
    n = layout.n_chunks
    kw = dict(flops_per_step=cfg.flops_per_token(T) * B * T, resident=list(range(n // 4)), split=False)
    free = plan_schedule(layout, traces, cb, 10**12, **kw)
    host = int(a.host_fraction * free.predicted.host_bytes)
    sched = plan_schedule(layout, traces, cb, 10**12, host_budget_bytes=host,
                          storage_devices=1 if a.storage_dir else 0, **kw)
    storage = (StorageOptions((a.storage_dir,), fsync=True, keep_previous=False) if sched.predicted.storage_chunks
               else None)
    step = cj.make_chunked_step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.bfloat16,
                                storage=storage)
    leaf = gpt.leaf_initializer(cfg, jax.random.key(a.seed), layout)
    drawn = [np.asarray(leaf(i)) for i in range(len(layout.slots))]  # drawn once: a GPU draws ~free
    return step, drawn.__getitem__, layout, sched


def profile(step, leaf_at, layout) -> dict:
    """Run ``step.init(leaf_at)`` with its parts timed; returns ``{"total_s", "parts": {name: [s, calls]}, "state"}``."""
    import jax

    from chunkjax import updaters as upd
    tm = Timers()
    ups = dict(step.updaters)
    for k in list(ups):
        ups[k] = ups[k]._replace(init=tm.wrap(f"init {k}", ups[k].init))
    topo = step.topology
    cls = type(layout)
    with contextlib.ExitStack() as st:
        step.__dict__["updaters"] = ups  # the cached property's value, for this init
        st.enter_context(patched(upd, "pinned_master", tm.wrap("pinned master", upd.pinned_master)))
        st.enter_context(patched(cls, "host_chunks", tm.wrap_iter("chunk fill (with leaf draws)", cls.host_chunks)))
        put = type(topo).put
        st.enter_context(patched(type(topo), "put", lambda self, x, sh: tm.wrap("put", put)(self, x, sh)))
        t0 = time.perf_counter()
        state = step.init(tm.wrap("leaf draw", leaf_at))
        jax.block_until_ready([p for p in state.params])
        total = time.perf_counter() - t0
    return {"total_s": total, "parts": {k: [round(tm.s[k], 3), tm.n[k]] for k in tm.s}, "state": state}


def state_digest(state, sched) -> str:
    """sha256 over every chunk's compute params, master params and optimizer state bytes (a
    storage chunk's read back from its file): equal digests, bit-identical states."""
    import hashlib

    import jax
    import numpy as np

    from chunkjax import host_update as hu
    h = hashlib.sha256()
    for c, u in enumerate(sched.update_locations):
        parts = [state.params[c]]
        if u == "storage":
            parts += list(state.master[c].read(c))
        else:
            st = state.opt_state[c]
            parts += [state.master[c]] + ([getattr(st, f) for f in hu.moment_fields(st)] if u == "host"
                                          else [x for x in jax.tree.leaves(st) if hasattr(x, "dtype")])
        for x in parts:
            h.update(np.ascontiguousarray(np.asarray(x)).view(np.uint8).tobytes())
    return h.hexdigest()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--chunk-size", type=int, default=2**21)
    ap.add_argument("--host-fraction", type=float, default=0.8, help="host budget / the all-host plan's host bytes")
    ap.add_argument("--storage-dir", default=None, help="a directory for the storage chunks (default a temporary one)")
    ap.add_argument("--no-storage", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not a.no_storage and a.storage_dir is None:
        a.storage_dir = tempfile.mkdtemp(prefix="cj_init_")
    step, leaf_at, layout, sched = build(a)
    r = profile(step, leaf_at, layout)
    state = r.pop("state")
    state_gb = sum(a.nbytes for a in __import__("jax").tree.leaves((state.params, state.master, state.opt_state))) / 1e9
    n = layout.n_chunks * layout.chunk_size
    r.update(chunk_size=layout.chunk_size, n_chunks=layout.n_chunks, counts=sched.counts(),
             master_fetch=len(sched.master_fetch), n_params=n, state_gb_in_process=state_gb,
             gb_per_s=16 * n / 1e9 / r["total_s"])
    print(f"init of {layout.n_chunks} chunks x {layout.chunk_size} ({sched.counts()}, {len(sched.master_fetch)} "
          f"master-fetch): {r['total_s']:.2f} s, {r['gb_per_s']:.2f} GB/s of 16 B/param")
    print("| part | s | calls |\n|---|---|---|")
    for k, (s, c) in sorted(r["parts"].items(), key=lambda x: -x[1][0]):
        print(f"| {k} | {s:.2f} | {c} |")
    r["digest"] = state_digest(state, sched)
    print("state sha256", r["digest"])
    for x in {id(x): x for x in state.master if hasattr(x, "close")}.values():
        x.close()
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(r, fh, indent=1)
    return r


if __name__ == "__main__":
    main()
