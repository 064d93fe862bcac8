"""The host AdamW kernel with numba's static division against the guided claims of
:mod:`chunkjax.kernel_threads` (issue 23, session 25), walked over the step's chunk layout beside loads.

Run on the lent H200 from the repository root: ``python experiments/gpu_checks/division_probe.py OUT.json [C K]``.
Layout and loads as ``host_rate_probe.py`` (session 18): K=24 chunks of C=39,321,600 params (float32 master
and moments in numpy, the bf16 gradient and compute params in ``pinned_host`` jax arrays); loads ``none`` and
``all`` (threads moving 256 MiB pinned host -> device and device -> pinned host, and 4096^2 bf16 matmuls).
The two kernels alternate pass by pass (4 passes each per load after a warm-up), so drift of the machine hits
both. Prints and writes ns/param (fastest and median pass) per kernel and load.
"""
import json
import statistics as S
import sys
import threading
import time

import numba
import numpy as np
from numba import prange

from chunkjax import kernels as K


@K._jit
def _static_adamw_kernel(master, m, v, grad_bits, grad_f32, is_bf16, out, grad_scale, hp, threads, ctr):
    n = master.size
    for blk in prange((n + K._BLOCK - 1) // K._BLOCK):
        lo, hi = blk * K._BLOCK, min(blk * K._BLOCK + K._BLOCK, n)
        if is_bf16:
            K._adamw_range(lo, hi, master, m, v, grad_bits, out, grad_scale, hp)
        else:
            K._adamw_range(lo, hi, master, m, v, grad_f32, out, grad_scale, hp)


def install_static():
    """Make :func:`chunkjax.kernels.update_` run the static-division AdamW kernel in this process."""
    K._adamw_kernel = _static_adamw_kernel


def main(out_path, C=39_321_600, KCH=24):
    import jax
    import jax.numpy as jnp

    from chunkjax.host_update import host_update_, writable_view
    from chunkjax.memory import sharding
    guided = K._adamw_kernel
    put = lambda x, k="pinned_host": jax.device_put(x, sharding(k))
    sp = K.AdamW(1e-4)
    g0 = np.random.default_rng(0).standard_normal(C, dtype=np.float32).astype(jnp.bfloat16)
    chunks = []
    for _ in range(KCH):
        st = sp.host_state(C)
        st.m.fill(0), st.v.fill(0)
        m = np.full(C, .01, np.float32)
        chunks.append((st, m, put(g0), put(m.astype(jnp.bfloat16))))

    def walk(kernel):
        K._adamw_kernel = kernel
        t0 = time.perf_counter()
        for st, m, g, p in chunks:
            host_update_(sp, st, np.asarray(g).view(np.uint16), m, writable_view(p, np.uint16))
        return (time.perf_counter() - t0) / KCH / C * 1e9

    h = put(np.zeros(2**27, jnp.bfloat16))
    d = put(np.zeros(2**27, jnp.bfloat16), "device")
    A = put(jnp.ones((4096, 4096), jnp.bfloat16), "device")
    mm = jax.jit(lambda a: a @ a * 1e-3)
    rows = []
    for load in ("none", "all", "none", "all"):
        ev = threading.Event()

        def up():
            while not ev.is_set():
                jax.device_put(h, sharding("device")).block_until_ready()

        def dn():
            while not ev.is_set():
                jax.device_put(d, sharding("pinned_host")).block_until_ready()

        def gp():
            x = A
            while not ev.is_set():
                for _ in range(8):
                    x = mm(x)
                x.block_until_ready()
        ths = [threading.Thread(target=f, daemon=True) for f in ({"none": [], "all": [up, dn, gp]}[load])]
        [t.start() for t in ths]
        time.sleep(0.2)
        walk(guided), walk(_static_adamw_kernel)  # warm-up (compile, caches)
        r = {"static": [], "guided": []}
        for _ in range(4):
            r["static"].append(walk(_static_adamw_kernel))
            r["guided"].append(walk(guided))
        ev.set()
        [t.join() for t in ths]
        row = {"load": load, **{f"{k}_min": round(min(v), 4) for k, v in r.items()},
               **{f"{k}_median": round(S.median(v), 4) for k, v in r.items()}}
        rows.append(row)
        print(row, flush=True)
    K._adamw_kernel = guided
    json.dump({"what": f"host AdamW ns/param, static vs guided division, {KCH} x {C:,} params, numba threads "
                       f"{numba.get_num_threads()}", "rows": rows}, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
