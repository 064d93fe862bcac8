"""Does the host AdamW kernel (:func:`chunkjax.kernels.update_`) run faster when its buffers sit on
transparent huge pages? (issue 23 item 1: the in-step host rate varied 0.27-0.39 ns/param between
processes on one lent H200.)

    PYTHONPATH=$PWD python experiments/gpu_checks/hugepage_probe.py [CHUNKS] > out.json

Prints the machine's transparent-huge-page settings, then for each allocation mode the kernel's
ns/param over CHUNKS (default 32) chunks of 39,321,600 parameters laid out as the step's host
chunks (float32 master and AdamW moments, bf16 gradient in, bf16 params out, each chunk its own
arrays; 16 bytes a parameter, 20 GB at 32 chunks), fastest and median of 5 passes after a warm-up,
and the ``AnonHugePages`` the allocation added:

* ``numpy``: ``np.empty`` (what the library allocates today), pages touched by one fill;
* ``huge``: anonymous ``mmap`` with ``madvise(MADV_HUGEPAGE)``;
* ``small``: the same with ``madvise(MADV_NOHUGEPAGE)`` (4 KiB pages for sure).
"""
import json
import mmap
import sys
import time

import numpy as np

from chunkjax import kernels as K

C = 39321600


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        return f"unreadable: {e}"


def anon_huge_bytes() -> int:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return -1


def alloc(n: int, dtype, mode: str) -> np.ndarray:
    dtype = np.dtype(dtype)
    if mode == "numpy":
        return np.empty(n, dtype)
    m = mmap.mmap(-1, n * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE if mode == "huge" else mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(m, dtype)


def chunks(k: int, mode: str):
    rng = np.random.default_rng(0)
    g = K.bf16_round_bits(rng.standard_normal(C, dtype=np.float32) * np.float32(1e-3))
    out = []
    for _ in range(k):
        master, m, v = (alloc(C, np.float32, mode) for _ in range(3))
        grad, bits = alloc(C, np.uint16, mode), alloc(C, np.uint16, mode)
        master.fill(0.01), m.fill(0), v.fill(0), bits.fill(0)
        grad[:] = g
        out.append((master, m, v, grad, bits))
    return out


def walk(sets, passes: int = 5):
    hyper = K.step_hyper(K.AdamW(1e-4, weight_decay=1e-4), 0, 1e-4)
    times = []
    for i in range(passes + 1):
        t0 = time.perf_counter()
        for master, m, v, grad, bits in sets:
            K.update_(hyper, master, (m, v), grad, bits)
        if i:
            times.append((time.perf_counter() - t0) / (len(sets) * C) * 1e9)
    return round(min(times), 4), round(float(np.median(times)), 4)


def main():
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    rec = {"thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
           "thp_defrag": _read("/sys/kernel/mm/transparent_hugepage/defrag"),
           "thp_shmem_enabled": _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
           "numa_nodes": _read("/sys/devices/system/node/online"),
           "numba_threads": K.numba.get_num_threads(), "chunks": k, "chunk_params": C, "rows": []}
    print(json.dumps({k_: v for k_, v in rec.items() if k_ != "rows"}), file=sys.stderr, flush=True)
    for mode in ("numpy", "huge", "small", "numpy", "huge"):
        a0 = anon_huge_bytes()
        t0 = time.perf_counter()
        sets = chunks(k, mode)
        alloc_s = time.perf_counter() - t0
        added = anon_huge_bytes() - a0
        best, med = walk(sets)
        row = {"mode": mode, "min_ns_per_param": best, "median_ns_per_param": med,
               "anon_huge_bytes_added": added, "alloc_and_fill_s": round(alloc_s, 2)}
        rec["rows"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        del sets
    print(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
