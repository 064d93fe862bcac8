"""What each operation of ``ChunkedStep.init`` leaves in host memory, one kind at a time (issue 24).

GPT3_15B host-only on the H200 (pool not preallocated) grew by ~18 GB of anonymous memory during
its init beyond the ~1.9 GB of master params the plan keeps pageable there (RssAnon 1.26 -> 19.5 GB
while RssShmem, the pinned masters, grew by 37 GB); the CPU does not show it (CPU-backend arrays
are host memory themselves). This probe runs the init's operations on ``--chunks`` chunks of
``--chunk-size`` elements each (defaults: GPT3_15B's chunk, 20 chunks = 4.2 GB of float32 per
operation), each kind on its own, and reads the ledger (:class:`chunkjax.host_ledger.HostLedger`:
RssAnon / RssShmem) after the operation, after ``block_until_ready`` and after glibc's
``malloc_trim``. Each kept array stays alive, as the state keeps it::

    python experiments/gpu_checks/host_init_probe.py --out $OUT/host_init_probe.json      # ~1 min on the H200
    python experiments/gpu_checks/host_init_probe.py --chunk-size 1048576 --chunks 4     # CPU smoke test

Operations (chunkjax's own code paths): ``device_master`` (a device chunk's master params and AdamW
state, :func:`chunkjax.updaters.device_updater`'s init from a float32 numpy chunk), ``device_params``
(its bf16 compute params put from numpy), ``pinned_master`` (a master-fetch chunk:
:func:`chunkjax.updaters.pinned_master`), ``pinned_params`` (bf16 params into pinned host),
``host_state`` (AdamW m and v, :func:`chunkjax.updaters.host_updater`'s init, written at init),
``leaf_via_pinned`` (the benchmark's leaf init: drawn on the device, read through pinned host).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

OPS = ("device_master", "device_params", "pinned_master", "pinned_params", "host_state", "leaf_via_pinned")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk-size", type=int, default=52_953_088, help="elements per chunk (GPT3_15B's plan)")
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from chunkjax import updaters as upd
    from chunkjax.host_ledger import HostLedger, release_free_heap
    from chunkjax.host_update import AdamW
    from chunkjax.memory import DEVICE, PINNED_HOST
    from chunkjax.topology import SingleDevice

    led = HostLedger(echo=lambda line: print(line, flush=True))
    led.mark("start")
    topo, n, spec = SingleDevice(), args.chunk_size, AdamW(1e-4)
    dev_upd = upd.device_updater(topo, spec.optax(), n, jnp.bfloat16, {DEVICE})
    host_upd = upd.host_updater(topo, spec, n, jnp.bfloat16)
    draw = jax.jit(lambda k: jax.random.normal(k, (n,), jnp.float32) * 0.02)
    led.mark("backend")
    kept, rows = [], {}
    for op in args.ops.split(","):
        if op not in OPS:
            ap.error(f"--ops: {op!r} is not one of {', '.join(OPS)}")
        before = led.mark(f"{op}: before")
        for c in range(args.chunks):
            buf = np.full(n, 0.01 * (c + 1), np.float32)  # a chunk as layout.host_chunks yields it (written)
            if op == "device_master":
                kept.append(dev_upd.init(buf, c))
            elif op == "device_params":
                kept.append(topo.put(buf.astype(jnp.bfloat16), topo.param_sharding(DEVICE)))
            elif op == "pinned_master":
                kept.append(upd.pinned_master(topo, buf))
            elif op == "pinned_params":
                kept.append(topo.put(buf.astype(jnp.bfloat16), topo.param_sharding(PINNED_HOST)))
            elif op == "host_state":
                kept.append(host_upd.init(buf, c))
            else:  # leaf_via_pinned: drawn on the device, read through pinned host memory, then dropped
                leaf = np.asarray(jax.device_put(draw(jax.random.key(c)), topo.param_sharding(PINNED_HOST)))
                buf[:] = leaf
                del leaf
            del buf
        after = led.mark(f"{op}: after")
        jax.block_until_ready([x for x in jax.tree.leaves(kept) if isinstance(x, jax.Array)])
        ready = led.mark(f"{op}: ready")
        trimmed = release_free_heap()
        done = led.mark(f"{op}: heap trimmed")
        gb = lambda a, b, k: round((getattr(b, k) - getattr(a, k)) / 1e9, 3)  # noqa: E731
        rows[op] = {"chunk_f32_gb": 4 * n * args.chunks / 1e9,
                    "anon_gb_after": gb(before, after, "anon_bytes"), "anon_gb_ready": gb(before, ready, "anon_bytes"),
                    "anon_gb_trimmed": gb(before, done, "anon_bytes"), "shmem_gb_trimmed": gb(before, done, "shmem_bytes"),
                    "trim_returned_gb": None if trimmed is None else round(trimmed / 1e9, 3)}
        print(op, rows[op], flush=True)
    out = {"platform": jax.default_backend(), "chunk_size": n, "chunks": args.chunks, "per_op": rows,
           "ledger": led.to_dict(), "env": {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_"))}}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
