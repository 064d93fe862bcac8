"""Host memory of the disk tier, process by process (issue 24: GPT3_18B with the disk tier left the
H200's machine ~0.3 GB of MemAvailable although the trainer's RSS matched its plan).

A GPT with some chunks planned ``storage`` (master params and AdamW state in chunk files, updated by
one near-storage worker per directory: :mod:`chunkjax.storage.worker`) runs a few steps on the CPU
while a sampler thread reads, every ``--every-s`` seconds, ``/proc/<pid>/status`` of this process
and of every worker (RssAnon, RssShmem, RssFile) and ``/proc/meminfo`` (Cached, Dirty, Writeback,
Shmem, MemAvailable). Each phase (init, step k) keeps the peak of each. The workers' peak RssAnon is
compared with one worker's share of :func:`chunkjax.host_memory.storage_host_bytes` and
:func:`chunkjax.host_memory.storage_process_bytes` (what the plan now counts)::

    JAX_PLATFORMS=cpu python experiments/storage_host_memory.py --chunk-size 4194304 --out /tmp/shm.json

Prints one line per phase and writes JSON (``--out``). CPU only: the compute dtype is bfloat16 as
on the GPU (the workers return bf16 bits); the trainer's own device memory is host memory here, so
only the workers' figures and the page cache carry over to a GPU run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_STATUS = {"RssAnon:": "anon", "RssShmem:": "shmem", "RssFile:": "file"}
_MEMINFO = ("MemAvailable", "Cached", "Dirty", "Writeback", "Shmem")


def status(pid) -> dict:
    """RssAnon / RssShmem / RssFile of ``pid`` in bytes ({} once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                k = line.split(None, 1)[0] if line.strip() else ""
                if k in _STATUS:
                    out[_STATUS[k]] = int(line.split()[1]) * 1024
    except OSError:
        return {}
    return out


def meminfo() -> dict:
    """The fields of :data:`_MEMINFO` from /proc/meminfo, bytes."""
    out = {}
    with open("/proc/meminfo") as fh:
        for line in fh:
            k = line.split(":", 1)[0]
            if k in _MEMINFO:
                out[k] = int(line.split()[1]) * 1024
    return out


class Sampler:
    """Peak RSS by kind of the trainer and of each worker, and peak page-cache figures, per phase."""

    def __init__(self, every_s: float):
        self.every_s, self.pids, self.phase = every_s, {}, "start"
        self.peaks: dict = {}
        self._stop = threading.Event()
        self.base = meminfo()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.every_s)

    def sample(self):
        p = self.peaks.setdefault(self.phase, {})
        for name, pid in [("trainer", os.getpid())] + list(self.pids.items()):
            for k, v in status(pid).items():
                key = f"{name}_{k}"
                p[key] = max(p.get(key, 0), v)
        m = meminfo()
        for k in ("Cached", "Dirty", "Writeback", "Shmem"):
            p[k] = max(p.get(k, 0), m[k] - self.base[k])
        p["MemAvailable_drop"] = max(p.get("MemAvailable_drop", 0), self.base["MemAvailable"] - m["MemAvailable"])

    def set_phase(self, phase: str):
        self.sample()
        self.phase = phase
        self.sample()

    def stop(self):
        self.sample()
        self._stop.set()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk-size", type=int, default=2**22, help="elements per chunk (4 Mi: 48 MiB chunk files)")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dirs", type=int, default=1, help="storage directories (one worker each)")
    ap.add_argument("--storage", default=None, help="parent of the storage directories (default a temporary one)")
    ap.add_argument("--io-mode", default="auto")
    ap.add_argument("--every-s", type=float, default=0.02)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import chunkjax as cj
    from chunkjax.host_memory import STORAGE_TRAINER_MESSAGES, storage_host_bytes, storage_process_bytes
    from chunkjax.host_update import AdamW
    from chunkjax.optim import state_bytes_per_chunk
    from chunkjax.plan import plan_schedule
    from chunkjax.storage.updater import StorageOptions
    from models import gpt

    spec = AdamW(1e-3, weight_decay=0.1)
    B, T = 2, 16
    cfg = gpt.get_config("micro", d_model=a.d_model, n_layers=a.layers, n_heads=4, vocab_size=512)
    params = gpt.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    batch = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32)
    stages = gpt.gpt_stages(cfg)
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), params, batch)
    layout = cj.build_layout(params, a.chunk_size, order)
    traces = cj.trace_stages(stages, layout, jax.ShapeDtypeStruct(batch.shape, jnp.int32), jnp.bfloat16)
    cb = cj.chunk_bytes(layout, jnp.bfloat16, state_bytes_per_chunk(spec.optax(), layout.chunk_size))
    kw = dict(flops_per_step=cfg.flops_per_token(T) * B * T, resident=[0], split=False)
    free = plan_schedule(layout, traces, cb, 10**12, **kw)
    sched = plan_schedule(layout, traces, cb, 10**12, host_budget_bytes=int(0.4 * free.predicted.host_bytes),
                          storage_devices=a.dirs, **kw)
    n_disk = sched.predicted.storage_chunks
    parent = a.storage or tempfile.mkdtemp(prefix="cj_shm_")
    dirs = tuple(os.path.join(parent, f"d{i}") for i in range(a.dirs))
    opts = StorageOptions(dirs, io_mode=a.io_mode, fsync=True, keep_previous=False)
    step = cj.make_chunked_step(stages, layout, sched, host_optimizer=spec, compute_dtype=jnp.bfloat16, storage=opts)

    sampler = Sampler(a.every_s)
    sampler.set_phase("init")
    state = step.init(params)
    disk = state.master[sched.update_locations.index("storage")]
    sampler.pids = {f"worker{i}": pid for i, pid in enumerate(disk.opt.worker_pids)}
    times = {}
    for k in range(1, a.steps + 1):
        sampler.set_phase(f"step {k}")
        t0 = time.perf_counter()
        state, m = step(state, batch)
        step.wait(state)
        jax.block_until_ready(m["loss"])
        times[f"step {k}"] = time.perf_counter() - t0
    sampler.set_phase("after")
    sampler.stop()
    io_mode = dict(disk.opt.io_mode)
    disk.close()
    per_worker = n_disk // a.dirs + (n_disk % a.dirs > 0)
    model = (storage_host_bytes(cj.predict.disk_file_bytes(cb), 1)  # one worker: its staging buffers,
             + storage_process_bytes(1, cb.grad) - STORAGE_TRAINER_MESSAGES * cb.grad)  # its base and messages
    out = {"chunk_size": layout.chunk_size, "n_chunks": layout.n_chunks, "storage_chunks": n_disk,
           "chunks_per_worker": per_worker, "dirs": a.dirs, "io_mode": io_mode,
           "file_bytes": cj.predict.disk_file_bytes(cb), "counts": sched.counts(), "step_s": times,
           "worker_bytes_accounted": model, "peaks": sampler.peaks}
    worst = max((v for ph, p in sampler.peaks.items() for k, v in p.items() if k.endswith("_anon")
                 and k.startswith("worker")), default=0)
    out["worker_anon_peak"] = worst
    for ph, p in sampler.peaks.items():
        w = {k: v for k, v in p.items() if k.startswith("worker")}
        print(f"{ph:8s} trainer anon {p.get('trainer_anon', 0) / 1e6:8.1f} MB | "
              + " ".join(f"{k} {v / 1e6:.1f}" for k, v in sorted(w.items()))
              + f" | cached +{p['Cached'] / 1e6:.1f} dirty {p['Dirty'] / 1e6:.1f} writeback {p['Writeback'] / 1e6:.1f}"
              f" MemAvailable -{p['MemAvailable_drop'] / 1e6:.1f} MB")
    print(f"chunk {layout.chunk_size} elements, file {out['file_bytes'] / 1e6:.1f} MB, {n_disk} storage chunks in "
          f"{a.dirs} dir(s), io {io_mode}: worker RssAnon peak {worst / 1e6:.1f} MB, accounted {model / 1e6:.1f} MB")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main()
