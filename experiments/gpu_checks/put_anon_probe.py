"""Which way of putting a float32 numpy chunk on the device leaves host anonymous memory behind
(issue 24: ``host_init_probe.py`` on the H200, session 15: a device chunk's init,
``jax.device_put(numpy, device)``, left ~0.19 GB of RssAnon per 0.21 GB chunk after the numpy
buffer was deleted, ``block_until_ready`` and ``malloc_trim``; GPT3_15B's 137 device chunks would
leave ~26 GB).

Each variant (in its own process) puts ``--chunks`` chunks of ``--chunk-size`` float32 elements (each a fresh numpy
buffer, deleted after the put, the device array kept) and reports RssAnon/RssShmem growth::

    python experiments/gpu_checks/put_anon_probe.py --out $OUT/put_anon_probe.json   # ~1 min on the H200
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

VARIANTS = ("device_put", "device_put_async", "via_pinned", "via_pinned_async", "pieces", "jnp_array", "dlpack")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk-size", type=int, default=52_953_088)
    ap.add_argument("--chunks", type=int, default=10)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.child:  # each variant in a fresh process: the runtime's host pools grow once per process
        import subprocess
        rows = {}
        for v in args.variants.split(","):
            r = subprocess.run([sys.executable, __file__, "--child", "--variants", v, "--chunks", str(args.chunks),
                                "--chunk-size", str(args.chunk_size)], capture_output=True, text=True)
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("ROW ")]
            rows[v] = json.loads(line[-1][4:]) if line else {"error": r.stderr[-500:]}
        if args.out:
            with open(args.out, "w") as fh:
                json.dump({"chunk_size": args.chunk_size, "chunks": args.chunks, "per_variant": rows}, fh, indent=1)
        print(f"{'variant':18s} {'f32 GB':>7s} {'anon GB':>8s} {'trimmed':>8s} {'shmem':>7s}")
        for v, r in rows.items():
            if "error" in r:
                print(f"{v:18s} error {r['error'][-200:]}")
                continue
            print(f"{v:18s} {r['chunk_f32_gb']:7.2f} {r['anon_gb_ready']:8.2f} {r['anon_gb_trimmed']:8.2f} {r['shmem_gb']:7.2f}")
        return 0

    import jax
    import jax.numpy as jnp
    import numpy as np

    from chunkjax.host_ledger import HostLedger, release_free_heap
    from chunkjax.memory import DEVICE, PINNED_HOST, sharding

    led = HostLedger(echo=lambda line: print(line, flush=True))
    dev, pin, n = sharding(DEVICE), sharding(PINNED_HOST), args.chunk_size
    piece = 1 << 22
    rows, kept = {}, []
    for v in args.variants.split(","):
        before = led.mark(f"{v}: before")
        for c in range(args.chunks):
            buf = np.full(n, 0.01 * (c + 1), np.float32)
            if v in ("device_put", "device_put_async"):
                x = jax.device_put(buf, dev)
            elif v in ("via_pinned", "via_pinned_async"):
                x = jax.device_put(jax.device_put(buf, pin), dev)
            elif v == "pieces":
                x = jnp.concatenate([jax.device_put(buf[i:i + piece], dev) for i in range(0, n, piece)])
            elif v == "jnp_array":
                x = jnp.array(buf)
            else:
                x = jax.dlpack.from_dlpack(buf)  # host-side zero copy, then to the device
                x = jax.device_put(x, dev)
            if not v.endswith("_async"):
                x.block_until_ready()
            kept.append(x)
            del buf, x
        jax.block_until_ready(kept)
        ready = led.mark(f"{v}: ready")
        release_free_heap()
        done = led.mark(f"{v}: trimmed")
        gb = lambda a, b, k: round((getattr(b, k) - getattr(a, k)) / 1e9, 3)  # noqa: E731
        rows[v] = {"chunk_f32_gb": round(4 * n * args.chunks / 1e9, 3), "anon_gb_ready": gb(before, ready, "anon_bytes"),
                   "anon_gb_trimmed": gb(before, done, "anon_bytes"), "shmem_gb": gb(before, done, "shmem_bytes")}
        print("ROW " + json.dumps(rows[v]), flush=True)
        for x in kept:
            x.delete()
        kept.clear()
        gc.collect()
        release_free_heap()
        led.mark(f"{v}: after delete")
    return 0


if __name__ == "__main__":
    sys.exit(main())
