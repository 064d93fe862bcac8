"""The near-storage worker process (Smart-Infinity's SmartUpdate): one per storage directory.

It owns that directory's chunk files (:class:`chunkjax.storage.tier.DiskTier`) and applies the
optimizer step to each chunk next to the storage, with the kernels of :mod:`chunkjax.kernels` (the
host tier's, so both tiers give the same bits for one spec). It takes gradients (dense, or top-k
index + value pairs) and the step's scalars (:func:`chunkjax.kernels.step_hyper`,
:func:`chunkjax.kernels.clip_scale`) from the trainer
(:class:`chunkjax.storage.near.NearStorageOptimizer`) over a pipe and returns bf16 params as bits.
This module imports numpy, numba and :mod:`chunkjax.storage`, not jax or ml_dtypes, so a spawned
worker starts in about 0.5 s (docs/storage.md, "Worker start").
"""
from __future__ import annotations

import os
import threading
import time

import numba
import numpy as np

from chunkjax.kernels import BF16_BITS_DTYPE, MASTER_DTYPE, StepHyper, bf16_round_bits, load_adamw_kernels, update_
from chunkjax.storage.files import StorageError
from chunkjax.storage.links import LinkModel
from chunkjax.storage.tier import DiskTier

#: A spawned process that reached the disk tier while importing the main script (the script has
#: no ``if __name__ == "__main__":`` guard) exits with this code (``EX_CONFIG``);
#: :class:`chunkjax.storage.pool.WorkerPool` turns it into one line saying to add the guard.
BOOTSTRAP_EXIT_CODE = 78
#: A worker stopped by SIGINT (Ctrl-C reaches the trainer's whole process group) exits with this
#: code, quietly, as a shell reports a command ended by SIGINT.
INTERRUPTED_EXIT_CODE = 130


def exit_if_spawned_import() -> None:
    """Exit quietly with :data:`BOOTSTRAP_EXIT_CODE` when called in a spawned process that is still
    importing the parent's main script (multiprocessing's bootstrapping phase): the script's
    training code runs at import, and starting the workers there would only print Python's
    bootstrapping RuntimeError. No effect anywhere else."""
    import multiprocessing.process as mp
    if getattr(mp.current_process(), "_inheriting", False):
        raise SystemExit(BOOTSTRAP_EXIT_CODE)


def _bits_or_f32(values: np.ndarray) -> np.ndarray:
    """A gradient payload as the kernels read it: bf16 (ml_dtypes, or its bits as uint16) as uint16
    bits, anything else as float32."""
    values = np.asarray(values)
    if values.dtype == BF16_BITS_DTYPE:
        return values
    if values.dtype.name == "bfloat16":
        return values.view(BF16_BITS_DTYPE)
    return values.astype(MASTER_DTYPE, copy=False)


def f32_of(values: np.ndarray) -> np.ndarray:
    """float32 values of a gradient payload: float32, or bf16 (ml_dtypes, or bits as uint16; exact)."""
    values = _bits_or_f32(values)
    if values.dtype == BF16_BITS_DTYPE:
        return (values.astype(np.uint32) << 16).view(MASTER_DTYPE)
    return values


def topk_decompress(indices: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """(n,) float32 array, zero except ``values`` (float32, bf16, or bf16 bits as uint16) at
    ``indices`` ((k,) int32). Inverse of :func:`chunkjax.storage.topk.topk_compress` on the kept
    entries."""
    out = np.zeros(n, MASTER_DTYPE)
    out[np.asarray(indices, np.int64)] = f32_of(values)
    return out


def lazy_update_(hyper: StepHyper, master: np.ndarray, moments: tuple[np.ndarray, ...], indices: np.ndarray,
                 values: np.ndarray, grad_scale: float = 1.0) -> None:
    """Lazy update on a top-k gradient (as ``tf.keras`` LazyAdam / ``torch.optim.SparseAdam``): only
    the entries at ``indices`` ((k,) int32) take a step, with ``values`` (float32 or bf16 bits);
    the others keep their master and moments unchanged (no moment decay, no weight decay) instead
    of taking the dense step on a zero gradient. Bias correction uses the global step count in
    ``hyper``. Same kernel as the dense step (:func:`chunkjax.kernels.update_`)."""
    idx = np.asarray(indices, np.int64)
    if idx.size == 0:
        return
    mp, ms = master[idx], tuple(a[idx] for a in moments)
    update_(hyper, mp, ms, np.ascontiguousarray(_bits_or_f32(values)), None, grad_scale)
    master[idx] = mp
    for a, x in zip(moments, ms):
        a[idx] = x


class _Stop(Exception):
    """The trainer ended a step before it was written ("skip": a non-finite gradient norm or an
    abandoned step; "abort": another worker failed)."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


def _worker_main(conn, cfg: dict):
    """One storage directory's worker: owns its DiskTier and runs the optimizer step next to it.
    When the trainer is gone (its pipe closed: killed, or exited without closing) the worker ends
    quietly; the chunk files stay at the last committed step. A Ctrl-C at a terminal (or a
    notebook's interrupt) reaches the trainer's whole process group, these workers too: the worker
    then exits with status :data:`INTERRUPTED_EXIT_CODE` and no traceback (the trainer, stopped by
    the same SIGINT, reports it once; the chunk files stay at the last committed step)."""
    try:
        _serve(conn, cfg)
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the trainer is gone: nothing to report to
        pass
    except KeyboardInterrupt:
        raise SystemExit(INTERRUPTED_EXIT_CODE) from None


def _serve(conn, cfg: dict):
    tier = None
    # the workers share the machine's cores: each kernel launch here uses this worker's share
    numba.set_num_threads(max(1, min(numba.config.NUMBA_NUM_THREADS, (os.cpu_count() or 1) // cfg["n_dirs"])))
    threading.Thread(target=load_adamw_kernels, args=(cfg["sizes"].values(),), name="load_kernels",
                     daemon=True).start()
    try:
        tier = DiskTier([cfg["dir"]], cfg["sizes"], dir_indices=[cfg["index"]], n_dirs_total=cfg["n_dirs"],
                        n_buffers=cfg["n_buffers"], read_ahead=cfg["n_buffers"] - 2, io_mode=cfg["io_mode"],
                        fsync=cfg["fsync"],
                        keep_previous=cfg.get("keep_previous", True),
                        link_model=LinkModel(disk_bytes_per_s=cfg["disk_bytes_per_s"]),
                        target_step=cfg["target_step"])
        conn.send(("ready", tier.committed_step, tier.io_mode))
    except Exception as e:  # noqa: BLE001 - reported to the trainer
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    try:
        _loop(conn, cfg, tier)
    finally:
        tier.close()


def _loop(conn, cfg: dict, tier) -> None:
    """Answer the trainer's messages until "close" or the end of the pipe."""
    fault = cfg.get("fault") or {}
    f32_params = cfg.get("param_dtype") == "float32"  # the new params as float32 (else bf16 bits)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        kind = msg[0]
        try:
            if kind == "close":
                break
            if kind == "init":
                tier.initialize(msg[1])
                conn.send(("ok", tier.committed_step))
            elif kind == "init_stream":  # a restored state: (master, m, v) per chunk, one message each

                def take(c, step=msg[1]):
                    m = conn.recv()
                    if m[0] != "init_chunk" or m[1] != c:
                        raise StorageError(f"restoring step {step}: expected chunk {c}, got {m[0]!r} {m[1]!r}")
                    return m[2] if isinstance(m[2], np.ndarray) else tuple(m[2])  # master alone: zero moments

                tier.initialize(take, step=msg[1])
                conn.send(("ok", tier.committed_step))
            elif kind == "read_chunk":
                conn.send(("chunk", msg[1], tier.read_chunk(msg[1])))
            elif kind == "step":  # the header: the reads start now; scalars now or in a later message
                _, step, order, scalars = msg
                if step != tier.committed_step + 1:
                    raise StorageError(f"asked for step {step}, committed step is {tier.committed_step}")
                done, box, have = [0], {}, dict(scalars=scalars)
                r0 = sum(tier.bytes_read.values())

                def take(c, box=box, have=have, step=step, r0=r0):
                    """Receive until chunk c's gradient and the step's scalars are here (gradients of
                    other chunks wait in ``box``); "skip"/"abort" ends the step unwritten."""
                    while c not in box or have["scalars"] is None:
                        m = conn.recv()
                        if "ahead" not in have:  # the read-ahead: what the staging buffers hold by now
                            have["ahead"] = sum(tier.bytes_read.values()) - r0
                        if m[0] in ("skip", "abort") and m[1] == step:
                            raise _Stop(m[0])
                        if m[0] == "scalars" and m[1] == step:
                            have["scalars"] = m[2]
                        elif m[0] == "grads" and m[1] == step:
                            box.update(m[2])
                        else:
                            raise StorageError(f"expected the gradients of step {step}, got {m[0]!r}")
                    return box.pop(c), have["scalars"]

                def fn(c, views, done=done, step=step):
                    p, (scale, hyper) = take(c)
                    if p[0] == "topk" and cfg.get("sparse_update") == "lazy":
                        lazy_update_(hyper, views[0], views[1:], p[1], p[2], scale)
                        out = views[0].copy() if f32_params else bf16_round_bits(views[0])
                    else:
                        g = topk_decompress(p[1], p[2], tier.chunk_sizes[c]) if p[0] == "topk" else _bits_or_f32(p[1])
                        out = None if f32_params else np.empty(views[0].size, BF16_BITS_DTYPE)
                        update_(hyper, views[0], views[1:], g, out, scale)  # bf16 bits of the new params
                        out = views[0].copy() if f32_params else out
                    conn.send(("param", c, out))  # streamed back at once
                    done[0] += 1
                    if fault.get("step") == step and done[0] == fault.get("after_chunks", 1):
                        with open(fault["marker"] + ".tmp", "w") as f:  # test hook: wait here to be killed
                            f.write(str(os.getpid()))
                        os.replace(fault["marker"] + ".tmp", fault["marker"])  # whole: a reader never sees it empty
                        time.sleep(fault.get("sleep_s", 3600))

                if fault.get("fsize_limit_at_step") == step:  # test hook: a full disk from this step on
                    import resource
                    import signal
                    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                    resource.setrlimit(resource.RLIMIT_FSIZE, (fault["fsize_limit"], fault["fsize_limit"]))
                ids = None if order is None else [c for c in order if c in tier.chunk_sizes]
                if ids is not None and sorted(ids) != sorted(tier.chunk_sizes):
                    raise StorageError(f"step {step}: the chunk order names {sorted(ids)}, this worker holds "
                                       f"{sorted(tier.chunk_sizes)}")
                try:
                    io = tier.update(fn, chunk_ids=ids, commit=False)  # reads ahead into the staging buffers
                except _Stop as stop:  # nothing of this step written (the pipeline removed its files)
                    conn.send(("skipped" if stop.kind == "skip" else "aborted", step, tier.committed_step))
                    continue
                conn.send(("prepared", step, io.read, io.written, have.get("ahead", 0)))
            elif kind == "commit":
                if fault.get("exit_on_commit") == msg[1]:  # test hook: die between the two phases
                    os._exit(9)
                tier.commit()
                conn.send(("committed", tier.committed_step))
            elif kind in ("grads", "scalars"):  # of a step that failed here: the trainer aborts it next
                continue
            elif kind in ("abort", "skip"):  # a prepared step (or one that failed here) not committed
                tier.abort()
                conn.send(("skipped" if kind == "skip" else "aborted", msg[1], tier.committed_step))
            elif kind == "read":
                conn.send(("state", {c: tier.read_chunk(c) for c in tier.chunk_sizes}))
            else:
                raise ValueError(f"unknown message {kind!r}")
        except (EOFError, BrokenPipeError, ConnectionResetError):
            raise  # the trainer is gone (_worker_main ends quietly)
        except Exception as e:  # noqa: BLE001 - reported to the trainer
            conn.send(("error", f"{type(e).__name__}: {e}"))
