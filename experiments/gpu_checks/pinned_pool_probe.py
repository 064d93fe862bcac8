"""Where pinned-host arrays live on the GPU runtime: inside XLA's pinned pool or beside it (issue 24).

GPT3_15B was killed by the kernel's OOM killer in its first step with a preallocated 38 GiB pool
(`XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE=true`): shmem-rss 79.7 GB, about twice the pool. This probe
runs, in one child per setting, the ways chunkjax makes pinned-host arrays and prints the process's
RssAnon / RssShmem after each (GB of 1e9), so the host accounting can be checked per setting::

    python experiments/gpu_checks/pinned_pool_probe.py --gib 4 --out $OUT/pinned_pool.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def rss() -> dict:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            k, _, v = line.partition(":")
            if k in ("RssAnon", "RssShmem", "RssFile"):
                out[k] = round(int(v.split()[0]) * 1024 / 1e9, 3)
    return out


def child(gib: float) -> list:
    import jax
    import jax.numpy as jnp
    import numpy as np
    rows = []
    mark = lambda what: rows.append({"stage": what, **rss()}) or print(what, rows[-1], flush=True)
    mark("import")
    dev = jax.devices()[0]
    mark("backend")
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    devs = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    n = int(gib * 2**30 / 4)
    pieces = 8
    host = [np.random.default_rng(i).standard_normal(n // pieces, dtype=np.float32) for i in range(pieces)]
    mark("numpy made")
    put = [jax.device_put(h, pinned) for h in host]
    jax.block_until_ready(put)
    mark("device_put numpy -> pinned_host")
    del host
    mark("numpy freed")
    on_dev = [jax.device_put(p, devs) for p in put]
    jax.block_until_ready(on_dev)
    mark("pinned_host -> device")
    f = jax.jit(lambda x: x * 2, out_shardings=pinned)
    outs = [f(d) for d in on_dev]
    jax.block_until_ready(outs)
    mark("jit output in pinned_host")
    g = jax.jit(lambda x: (x + 1).astype(jnp.bfloat16), out_shardings=pinned)
    outs2 = [g(p) for p in put]
    jax.block_until_ready(outs2)
    mark("jit pinned_host in -> pinned_host out")
    del put, outs, outs2
    mark("pinned freed")
    big = np.ones(n, dtype=np.float32)
    d = jax.device_put(big, devs)
    jax.block_until_ready(d)
    mark("numpy -> device (one array)")
    del d
    try:  # beyond the pool's cap: an error, or pinned memory beside the pool?
        over = [jax.device_put(big, pinned) for _ in range(4)]
        jax.block_until_ready(over)
        mark("4 x numpy -> pinned_host (over the cap)")
        del over
    except Exception as e:  # noqa: BLE001 - recorded
        rows.append({"stage": "over the cap", "error": str(e)[:300], **rss()})
        print("over the cap:", str(e)[:300], flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0, help="GiB of float32 per stage")
    ap.add_argument("--limit-gib", type=int, default=16)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print("ROWS " + json.dumps(child(a.gib)), flush=True)
        return 0
    res = {}
    for name, pre in (("grow", None), ("preallocated", "true")):
        env = dict(os.environ, XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=str(a.limit_gib), XLA_PYTHON_CLIENT_PREALLOCATE="false")
        env.pop("XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE", None)
        if pre:
            env["XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE"] = pre
        p = subprocess.run([sys.executable, __file__, "--child", "--gib", str(a.gib)], env=env, capture_output=True,
                           text=True, timeout=240)
        rows = [json.loads(l[5:]) for l in p.stdout.splitlines() if l.startswith("ROWS ")]
        res[name] = {"rc": p.returncode, "rows": rows[0] if rows else None, "stderr_tail": p.stderr[-1500:]}
        print(f"== {name} (limit {a.limit_gib} GiB, {a.gib} GiB per stage) rc={p.returncode}")
        for r in (rows[0] if rows else []):
            print(f"  {r['stage'][:40]:40s} anon {r.get('RssAnon', 0):7.2f}  shmem {r.get('RssShmem', 0):7.2f}  file {r.get('RssFile', 0):6.2f} {r.get('error', '')[:120]}")
        if p.returncode:
            print(p.stderr[-800:])
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
