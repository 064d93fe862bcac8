"""The near-storage worker process (Smart-Infinity's SmartUpdate): one per storage directory.

It owns that directory's chunk files (:class:`chunkjax.storage.DiskTier`) and applies AdamW to each
chunk next to the storage, in float32 numpy. It takes gradients (dense, or top-k index + value
pairs) from the trainer (:class:`chunkjax.near_storage.NearStorageOptimizer`) over a pipe and
returns bf16 params. This module imports only numpy, ml_dtypes and :mod:`chunkjax.storage`, not jax,
so a spawned worker starts in a fraction of a second.
"""
from __future__ import annotations

import os
import time

import ml_dtypes
import numpy as np

from chunkjax.storage import DiskTier, LinkModel, StorageError

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


def adamw_numpy_(master: np.ndarray, m: np.ndarray, v: np.ndarray, grad: np.ndarray, clip: tuple | None,
                 hp: tuple) -> None:
    """One AdamW step in place on (n,) float32 ``master``, ``m``, ``v`` with (n,) float32 ``grad``;
    ``hp`` from :func:`adamw_hyper`. Same float32 operations, in the same order, as
    ``chunkjax.host_update``'s kernel (optax's bias-correction divisions as multiplies by the
    float32 reciprocal, as XLA does).

    ``clip``: None (no clipping), or ``(global_norm, max_norm)`` (float32) from :func:`clip_args`:
    the gradient becomes ``(g / global_norm) * max_norm``, as ``optax.clip_by_global_norm``."""
    b1, omb1, b2, omb2, inv_bc1, inv_bc2, eps, wd, neg_lr = hp
    if clip is None:
        g = grad.copy()
    else:
        g = grad / np.float32(clip[0])
        g *= np.float32(clip[1])
    m *= b1
    m += omb1 * g  # (1-b1) g + b1 m: one rounding per op, a+b == b+a
    g *= g
    v *= b2
    v += omb2 * g
    u = m * inv_bc1
    d = v * inv_bc2
    np.sqrt(d, out=d)
    d += eps
    u /= d
    if wd != 0:  # optax skips a zero weight decay
        u += wd * master
    u *= neg_lr
    master += u


def adamw_lazy_(master: np.ndarray, m: np.ndarray, v: np.ndarray, indices: np.ndarray, values: np.ndarray,
                clip: tuple | None, hp: tuple) -> None:
    """Lazy AdamW on a top-k gradient (as ``tf.keras`` LazyAdam / ``torch.optim.SparseAdam``): only
    the entries at ``indices`` (int32, (k,)) take a step, with float32 ``values`` (or bf16 bits);
    the others keep their master, m and v unchanged (no moment decay, no weight decay) instead of
    taking the dense step on a zero gradient. Bias correction uses the global step count ``hp``."""
    idx = np.asarray(indices, np.int64)
    if idx.size == 0:
        return
    values = np.asarray(values)
    if values.dtype == BF16:
        values = values.view(np.uint16)
    mp, ms, vs = master[idx], m[idx], v[idx]
    adamw_numpy_(mp, ms, vs, _f32_of(values), clip, hp)
    master[idx], m[idx], v[idx] = mp, ms, vs


def _f32_of(payload: np.ndarray) -> np.ndarray:
    """float32 values of a gradient payload: float32, or bf16 carried as uint16 bits (exact)."""
    if payload.dtype == np.uint16:
        return (payload.astype(np.uint32) << 16).view(F32)
    return payload.astype(F32, copy=False)


def topk_decompress(indices: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """(n,) float32 array, zero except ``values`` (float32, bf16, or bf16 bits as uint16) at
    ``indices`` (int32). Inverse of :func:`topk_compress` on the kept entries."""
    out = np.zeros(n, F32)
    values = np.asarray(values)
    if values.dtype == BF16:
        values = values.view(np.uint16)
    out[np.asarray(indices, np.int64)] = _f32_of(values)
    return out


def _worker_main(conn, cfg: dict):
    """One storage directory's worker: owns its DiskTier and runs AdamW next to it."""
    tier = None
    try:
        tier = DiskTier([cfg["dir"]], cfg["sizes"], dir_indices=[cfg["index"]], n_dirs_total=cfg["n_dirs"],
                        n_buffers=cfg["n_buffers"], io_mode=cfg["io_mode"], fsync=cfg["fsync"],
                        link_model=LinkModel(disk_bytes_per_s=cfg["disk_bytes_per_s"]),
                        target_step=cfg["target_step"])
        conn.send(("ready", tier.committed_step, tier.io_mode))
    except Exception as e:  # noqa: BLE001 - reported to the trainer
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    fault = cfg.get("fault") or {}
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
                    return tuple(m[2])

                tier.initialize(take, step=msg[1])
                conn.send(("ok", tier.committed_step))
            elif kind == "read_chunk":
                conn.send(("chunk", msg[1], tier.read_chunk(msg[1])))
            elif kind == "step":
                _, step, scale, hp, grads = msg
                if step != tier.committed_step + 1:
                    raise StorageError(f"asked for step {step}, committed step is {tier.committed_step}")
                done, box = [0], {"grads": grads}

                def fn(c, views, box=box, done=done, step=step, scale=scale, hp=hp):
                    if box["grads"] is None:  # the header came first: the state reads have started
                        m = conn.recv()
                        if m[0] != "grads" or m[1] != step:
                            raise StorageError(f"expected the gradients of step {step}, got {m[0]!r}")
                        box["grads"] = m[2]
                    p = box["grads"].pop(c)
                    if p[0] == "topk" and cfg.get("sparse_update") == "lazy":
                        adamw_lazy_(views[0], views[1], views[2], p[1], p[2], scale, hp)
                    else:
                        g = topk_decompress(p[1], p[2], tier.chunk_sizes[c]) if p[0] == "topk" else _f32_of(p[1])
                        adamw_numpy_(views[0], views[1], views[2], g, scale, hp)
                    conn.send(("param", c, views[0].astype(BF16).view(np.uint16)))  # streamed back at once
                    done[0] += 1
                    if fault.get("step") == step and done[0] == fault.get("after_chunks", 1):
                        with open(fault["marker"], "w") as f:  # test hook: wait here to be killed
                            f.write(str(os.getpid()))
                        time.sleep(fault.get("sleep_s", 3600))

                if fault.get("fsize_limit_at_step") == step:  # test hook: a full disk from this step on
                    import resource
                    import signal
                    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                    resource.setrlimit(resource.RLIMIT_FSIZE, (fault["fsize_limit"], fault["fsize_limit"]))
                io = tier.update(fn, commit=False)
                conn.send(("prepared", step, io.read, io.written))
            elif kind == "commit":
                if fault.get("exit_on_commit") == msg[1]:  # test hook: die between the two phases
                    os._exit(9)
                tier.commit()
                conn.send(("committed", tier.committed_step))
            elif kind == "abort":
                tier.abort()
                conn.send(("aborted", tier.committed_step))
            elif kind == "read":
                conn.send(("state", {c: tier.read_chunk(c) for c in tier.chunk_sizes}))
            else:
                raise ValueError(f"unknown message {kind!r}")
        except Exception as e:  # noqa: BLE001 - reported to the trainer
            conn.send(("error", f"{type(e).__name__}: {e}"))
    tier.close()
