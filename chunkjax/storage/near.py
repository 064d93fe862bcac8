"""Near-storage optimizer updates: Smart-Infinity's SmartUpdate, one worker process per storage device.

Smart-Infinity (Jang et al., HPCA 2024, arXiv 2403.06664) observes that with the optimizer state
on storage (ZeRO-Infinity's NVMe offload), the shared host <-> storage link carries the whole state
every step: read fp32 master, m, v (12 bytes/param) and write them back (12), plus the gradients
and params. Its *SmartUpdate* (section "SmartUpdate") runs the update next to each storage device
(on an FPGA in the paper), so the shared link carries only gradients in and updated
compute-dtype params out (bf16 + bf16 = 4 bytes/param here), while each device's own link carries
its shard of the state. Its *gradient compression* (section "Gradient Compression") sends only the
top-k gradient entries of each chunk (:mod:`chunkjax.storage.topk`).

:class:`NearStorageOptimizer`, on CPU processes: one worker process per storage directory (the
"SmartSSD", :mod:`chunkjax.storage.worker`) owns the directory's chunk files (a
:class:`~chunkjax.storage.tier.DiskTier` over that directory only, with the data transfer handler's
fixed staging buffers) and runs AdamW there. The trainer computes the global gradient norm (for
``clip_by_global_norm``) and the overflow / non-finite check *before* sending; a non-finite step
changes no state. Steps use a two-phase commit: every worker writes step N to new files and
reports, then the trainer tells all to commit; a worker that dies, stops answering or taking
messages (every send and receive has a deadline), or fails (a full disk, a corrupt chunk file)
raises :class:`StorageError` with one line naming it and every shard stays at (or recovers to)
the last step all completed. A new optimizer over the same directories resumes from there.
A step has two phases (:meth:`NearStorageOptimizer.begin`, :meth:`~NearStorageOptimizer.finish`):
the header starts every worker's reads of its chunks' state into its staging buffers before any
gradient or norm exists (read-ahead, bounded by ``n_buffers``); the scalars and the gradients
follow (on a norm-free step the scalars come with the header and each chunk updates as its
gradient arrives). :meth:`~NearStorageOptimizer.step` is both at once.
Optional error feedback (the paper has none): the residual ``g - decompress(compress(g))`` of each
chunk stays on the trainer (optionally decayed) and is added to the next step's gradient; it is
written to storage with each committed step, so a resumed run continues exactly.

Accounting (per step, bytes): the shared link (trainer <-> workers: gradient payload in, i.e. the
gradient, or top-k indices (int32) + values; params out) and each storage device's own link (its
directory's reads + writes). :class:`~chunkjax.storage.links.LinkModel` throttles both to given
rates; such results are an emulation and are labelled ``emulated: True``. Here the shared link is
throttled in the trainer process (all its traffic passes there, one transfer at a time) and each
device link in its worker.

The AdamW arithmetic is :mod:`chunkjax.kernels` (optax's ``adamw``: ``scale_by_adam``,
``add_decayed_weights``, ``scale_by_learning_rate``), the kernels and scalars the host tier runs:
for one spec the two tiers give bit-identical master params and moments. Against eager optax the
unclipped step is bit-exact on one array; on a list of chunks optax differed in the last bit or two
of some master params (20 steps, ``tests/test_storage.py``: within rtol 1e-6). Clipping multiplies
by one float32 factor (:func:`chunkjax.kernels.clip_scale`); the norm is taken over the
uncompressed gradient.

Params leave the workers as bf16 only (the compute dtype of this project).
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from chunkjax.kernels import AdamW
from chunkjax.storage.chunk_io import StorageChunks
from chunkjax.storage.files import StorageError, committed_step, replace_file
from chunkjax.storage.links import Link, LinkModel
from chunkjax.storage.pool import WorkerPool
from chunkjax.storage.topk import (normalize_topk_groups, topk_compress, topk_compress_global, topk_compress_many,
                                   topk_k, topk_ratio_at, validate_topk_groups)
from chunkjax.storage.trainer import StepResult, TierTrainer, validate_storage_dirs

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)

class NearStorageOptimizer(TierTrainer, WorkerPool):
    """AdamW with the state on storage and the update next to it (Smart-Infinity's SmartUpdate).

    One worker process (multiprocessing, "spawn") per directory owns that directory's chunk files
    (chunk c in ``dirs[c % len(dirs)]``, layout in :mod:`chunkjax.storage.files`) and updates its chunks;
    the trainer sends gradients (bf16 or fp32, dense or top-k) and receives updated bf16 params.

    Args:
      dirs: one directory per storage device (created if missing). If they hold a committed run,
        it is resumed at the last step all directories completed (``init_params`` is then ignored).
      chunk_sizes: (n_chunks,) elements per chunk (or ``{c: n}`` with ids 0..n_chunks-1).
      spec: :class:`chunkjax.kernels.AdamW` (learning rate float or schedule, b1, b2, eps,
        weight_decay, max_grad_norm for global-norm clipping).
      init_params: per chunk, the (n_c,) initial fp32 master params (for a fresh run).
      compression: None (dense gradients) or "topk".
      topk_ratio: fraction of the entries sent with "topk" (default 0.01).
      topk_scope: "chunk" (default, as the paper: ``topk_ratio`` of every chunk) or "global" (the
        ``topk_ratio`` largest entries of the whole gradient,
        :func:`~chunkjax.storage.topk.topk_compress_global`; same total bytes, spread over the chunks
        by gradient size).
      topk_groups: with ``topk_scope="global"``, fixed shares of the kept entries,
        ``[(share, [(chunk, start, stop), ...]), ...]`` (:func:`~chunkjax.storage.topk.chunk_ranges`
        builds the ranges of a leaf; :func:`~chunkjax.storage.topk.topk_compress_global`), e.g.
        ``[(0.5, <the token embedding>)]``; the elements in no group share the rest. Default: none.
      topk_warmup_steps: Deep Gradient Compression's sparsity warm-up
        (:func:`~chunkjax.storage.topk.topk_ratio_at`,
        starting at ``topk_warmup_start``); 0 (default): ``topk_ratio`` from the first step.
      error_feedback: keep each chunk's compression residual (float32, on the gradient's device)
        and add it to the next step's gradient (off by default, as in the paper).
      init_state: instead of ``init_params``, a restored state (what
        :func:`chunkjax.storage.restore.restore_storage_checkpoint` passes): a callable ``c -> (master,
        m, v)``, each (n_c,) float32, called once per chunk in id order and streamed to its worker
        (host memory: one chunk), committed as step ``init_step``. Ignored, like ``init_params``,
        when ``dirs`` hold a committed run. ``"stream"``: the caller streams the state chunk by
        chunk (:meth:`begin_init`, :meth:`init_chunk`, :meth:`end_init`).
      init_step: the committed step (= AdamW step count) of ``init_state`` (default 0).
      init_residual: with error feedback and ``init_state``, the residual per chunk ``{c: (n_c,)
        float32}`` at ``init_step`` (written to ``residual_dir`` before the workers commit);
        default zeros.
      sparse_update: with "topk", how a worker applies a sparse gradient: "dense" (default: the
        AdamW step on the decompressed gradient, zeros included, so every m and v decays) or
        "lazy" (:func:`~chunkjax.storage.worker.lazy_update_`: only the kept entries step).
      ef_decay: the kept residual is multiplied by this each step (1.0, default: classic error
        feedback; < 1 forgets old residual, bounding how large an entry's burst can grow).
      residual_dir: with error feedback, where the trainer writes each committed step's residuals
        (``ef_residual.step<N>.npy``, float32, 4 bytes/param/step: :attr:`StepResult.residual_bytes`,
        not counted on the shared link; put it on the trainer's own disk to keep them off it).
        Default: ``dirs[0]``. Written before the workers commit, the previous one removed after, so
        a resume (a new optimizer with ``error_feedback=True``) restores the residuals of the
        step it resumes at and continues exactly as an uninterrupted run.
      param_dtype: dtype of the params the workers send back: ``"bfloat16"`` (default, bits) or
        ``"float32"`` (the master params themselves: a step with float32 compute params).
      keep_previous: each worker's :class:`DiskTier` ``keep_previous`` (False: the state once on
        disk, a failed step not recoverable from the directories).
      link_model: emulated rates (bytes/s) of the shared link and of each device link.
      io_mode, n_buffers, fsync: passed to each worker's :class:`DiskTier`.
      timeout_s: longest wait on one worker, seconds: for a reply, and for a message to be taken
        (a send blocks while a stopped or hung worker does not read a payload larger than the pipe's
        buffer). On expiry every worker is stopped and :class:`StorageError` names the worker
        (index, pid, directory) and what it was doing; the state stays at the last committed step.
        A dead worker is detected at once. Set it above the longest step phase (the first reply
        waits for the reads of one chunk; a resume first reads and checks every chunk file).

    Raises:
      StorageError: a worker failed to start, the directories are inconsistent, or (from
        :meth:`step`) a worker died or a disk is full; the message names the worker and the last
        committed step.
    """

    def __init__(self, dirs: Sequence[str], chunk_sizes, spec: AdamW, *, init_params=None,
                 init_state=None, init_step: int = 0, init_residual=None,
                 compression: str | None = None, topk_ratio: float = 0.01, topk_scope: str = "chunk",
                 topk_groups=(), topk_warmup_steps: int = 0, topk_warmup_start: float = 0.25,
                 error_feedback: bool = False, ef_decay: float = 1.0, sparse_update: str = "dense",
                 residual_dir: str | None = None, param_dtype: str = "bfloat16", keep_previous: bool = True,
                 link_model: LinkModel | None = None, io_mode: str = "auto", n_buffers: int = 3, fsync: bool = True,
                 timeout_s: float = 300.0, _fault: dict | None = None):
        validate_storage_dirs(dirs)  # the whole configuration before any file or process
        if n_buffers < 3:
            raise ValueError(f"n_buffers={n_buffers}: the data transfer handler needs >= 3 staging buffers "
                             "(read k+1, update k, write k-1)")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0 seconds")
        self._init_common(chunk_sizes, spec, link_model)
        if compression not in (None, "topk"):
            raise ValueError(f"compression must be None or 'topk', got {compression!r}")
        topk_k(1, topk_ratio)  # validates the ratio
        topk_k(1, topk_warmup_start)
        if topk_scope not in ("chunk", "global"):
            raise ValueError(f"topk_scope must be 'chunk' or 'global', got {topk_scope!r}")
        if not 0 < ef_decay <= 1:
            raise ValueError(f"ef_decay={ef_decay}: must be in (0, 1]")
        self.topk_groups = normalize_topk_groups(topk_groups)
        if self.topk_groups:
            if compression != "topk" or topk_scope != "global":
                raise ValueError("topk_groups needs compression='topk' and topk_scope='global'")
            validate_topk_groups(self.topk_groups, list(self.chunk_sizes.values()))
        if sparse_update not in ("dense", "lazy"):
            raise ValueError(f"sparse_update must be 'dense' or 'lazy', got {sparse_update!r}")
        self.sparse_update = sparse_update
        if param_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"param_dtype must be 'bfloat16' or 'float32', got {param_dtype!r}")
        self.param_dtype = param_dtype
        self.dirs = [os.fspath(d) for d in dirs]
        self.compression, self.topk_ratio, self.error_feedback = compression, topk_ratio, error_feedback
        self.topk_scope, self.ef_decay = topk_scope, float(ef_decay)
        self.topk_warmup_steps, self.topk_warmup_start = int(topk_warmup_steps), float(topk_warmup_start)
        self.fsync = fsync
        self.residual_dir = os.fspath(residual_dir) if residual_dir is not None else self.dirs[0]
        self.timeout_s = timeout_s
        self.shared_link = Link(self.link_model.shared_bytes_per_s, "shared")
        self._residual: dict[int, jax.Array] = {}
        for d in self.dirs:
            os.makedirs(d, exist_ok=True)
        target = committed_step(self.dirs)  # the step every worker recovers to
        if self.error_feedback and compression == "topk":  # before any process: a missing file fails fast
            self._load_residual(target or 0)
        n = len(self.dirs)
        self.owned = [[c for c in self.chunk_sizes if c % n == i] for i in range(n)]
        self._step = target
        try:
            self._start_workers([dict(dir=d, index=i, n_dirs=n, sizes={c: self.chunk_sizes[c] for c in self.owned[i]},
                                      n_buffers=n_buffers, io_mode=io_mode, fsync=fsync, target_step=target,
                                      disk_bytes_per_s=self.link_model.disk_bytes_per_s, sparse_update=sparse_update,
                                      param_dtype=param_dtype, keep_previous=keep_previous,
                                      fault=_fault if _fault and _fault.get("worker") == i else None)
                                 for i, d in enumerate(self.dirs)])
            if target is None and init_state == "stream":
                pass  # the caller streams the state: begin_init, init_chunk per chunk, end_init
            elif target is None and init_state is not None:
                self._init_restored(init_state, int(init_step), init_residual)
            elif target is None:
                if init_params is None:
                    raise StorageError(f"{self.dirs} hold no committed run: pass init_params")
                for i in range(n):
                    masters = {c: np.asarray(init_params[c], F32).reshape(-1) for c in self.owned[i]}
                    self._send(i, ("init", masters), "initialising")
                for i in range(n):
                    self._expect(i, "ok", "initialising")
                self._step = 0
        except BaseException:
            self._kill_all()
            raise

    def _init_restored(self, init_state, step: int, init_residual) -> None:
        """Commit a restored state as step ``step``: the residual file first (error feedback), then
        every chunk's (master, m, v) streamed to its worker, one chunk in flight per call."""
        self.begin_init(step, init_residual)
        for c in self.chunk_sizes:
            kinds = tuple(init_state(c))
            if len(kinds) != 3:
                raise ValueError(f"init_state({c}) must give (master, m, v), got {len(kinds)} arrays")
            self.init_chunk(c, *kinds)
            del kinds
        self.end_init()

    def begin_init(self, step: int = 0, init_residual=None) -> None:
        """Start committing a fresh or restored state as step ``step`` (after ``init_state="stream"``):
        then :meth:`init_chunk` for every chunk in id order, then :meth:`end_init`.

        Raises:
          ValueError: ``step < 0``. StorageError: a worker failed (every worker is stopped).
        """
        if step < 0:
            raise ValueError(f"init_step must be >= 0, got {step}")
        if self.error_feedback and self.compression == "topk" and step > 0:
            res = {c: np.asarray(init_residual[c], F32).reshape(-1) if init_residual is not None
                   else np.zeros(n, F32) for c, n in self.chunk_sizes.items()}
            self._save_residual(step, res)
            self._residual = {c: jnp.asarray(r) for c, r in res.items()}
        for i in range(len(self.dirs)):
            self._send(i, ("init_stream", step), f"restoring step {step}")
        self._init_step = step

    def init_chunk(self, c: int, master, m=None, v=None, *, wait: bool = True) -> None:
        """Stream chunk ``c``'s (n_c,) float32-convertible master params and Adam moments (None:
        zeros, a fresh chunk) to its worker (host memory: this chunk).

        ``wait=False``: return once the previous chunk's message has gone, this one on its way
        (the caller prepares its next chunk while the worker takes this one and writes its file;
        host memory: this chunk and its pickled copy until then). The arrays must not change until
        the next call or :meth:`end_init`.

        Raises:
          ValueError: arrays of another size than chunk ``c``.
          StorageError: a worker died or took no message within ``timeout_s`` (every worker is
            stopped).
        """
        size = self.chunk_sizes[c]
        kinds = tuple(np.asarray(a, F32).reshape(-1) for a in (master, m, v) if a is not None)
        if len(kinds) not in (1, 3) or any(a.size != size for a in kinds):
            raise ValueError(f"chunk {c} needs master (and m, v) of {size} elements each, got "
                             f"{[a.size for a in kinds]}")
        # a fresh chunk: the master params alone, the worker writes the zero moments (a third of the bytes)
        msg = ("init_chunk", c, kinds if len(kinds) == 3 else kinds[0])
        doing = f"restoring chunk {c} of step {self._init_step}"
        if wait:
            self._sent()
            self._send(c % len(self.dirs), msg, doing)
        else:
            self._send_later(c % len(self.dirs), msg, doing)

    def end_init(self) -> None:
        """Wait for every worker to commit the streamed state (:meth:`begin_init`)."""
        self._sent()
        for i in range(len(self.dirs)):
            self._expect(i, "ok", f"restoring step {self._init_step}")
        self._step = self._init_step

    def chunk_io(self, layout, compute_dtype) -> StorageChunks:
        """The chunks through the checkpoint protocol (:class:`~chunkjax.storage.chunk_io.StorageChunks`)."""
        return StorageChunks(self, layout, compute_dtype)

    def read_chunk(self, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Chunk ``c``'s (master, m, v), (n_c,) float32 copies at the committed step, read by its
        worker (host memory: one chunk; :func:`chunkjax.checkpoint.save_storage_checkpoint`
        saves chunk by chunk with it)."""
        self._check_usable()
        if c not in self.chunk_sizes:
            raise ValueError(f"no chunk {c} (chunks 0..{len(self.chunk_sizes) - 1})")
        i = c % len(self.dirs)
        self._send(i, ("read_chunk", c), f"reading chunk {c}")
        _, got, arrays = self._expect(i, "chunk", f"reading chunk {c}")
        return arrays

    # -- error-feedback residuals on storage -------------------------------------------------
    def _residual_path(self, step: int) -> str:
        return os.path.join(self.residual_dir, f"ef_residual.step{step:09d}.npy")

    def _residual_files(self) -> dict[int, str]:
        out = {}
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.residual_dir):
                if name.startswith("ef_residual.step") and name.endswith(".npy"):
                    with contextlib.suppress(ValueError):
                        out[int(name[len("ef_residual.step"):-4])] = os.path.join(self.residual_dir, name)
        return out

    def _load_residual(self, step: int):
        """Restore the residuals of committed step ``step`` (zero at step 0) and remove the files of
        other steps (a step written but not committed everywhere, or one already superseded)."""
        os.makedirs(self.residual_dir, exist_ok=True)
        files = self._residual_files()
        if step > 0:
            if step not in files:
                raise StorageError(f"error feedback: no residual file for the committed step {step} in "
                                   f"{self.residual_dir} (the run was written without error_feedback, or with "
                                   "another residual_dir): resume with the same settings")
            flat = np.load(files[step])
            if flat.dtype != F32 or flat.shape != (self.n_params,):
                raise StorageError(f"{files[step]} holds {flat.dtype} {flat.shape}, expected float32 "
                                   f"({self.n_params},)")
            o = 0
            for c, n in self.chunk_sizes.items():
                self._residual[c] = jnp.asarray(flat[o:o + n])
                o += n
        for s, f in files.items():
            if s != step:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.residual_dir, "ef_residual.tmp.npy"))

    def _save_residual(self, step: int, residual: dict) -> int:
        """Write the residuals after ``step`` (before the workers commit it); returns the bytes."""
        flat = np.concatenate([np.asarray(residual[c], F32).reshape(-1) for c in self.chunk_sizes])
        try:
            replace_file(self._residual_path(step), os.path.join(self.residual_dir, "ef_residual.tmp.npy"),
                         lambda f: np.save(f, flat), self.fsync)
        except OSError as e:
            raise StorageError(f"writing the error-feedback residuals of step {step} to {self.residual_dir} "
                               f"failed ({e}); last committed step {self._step}") from e
        return flat.nbytes

    @property
    def committed_step(self) -> int:
        """The last step every worker committed (0: initial params)."""
        return self._step

    # -- the step ----------------------------------------------------------------------------
    def _compress(self, grads: list, step: int) -> tuple[dict, dict]:
        """Top-k of every chunk for ``step`` (1 = first): ``({c: (indices, values)}, new residuals)``;
        with error feedback the residual is added first and the new one (``ef_decay`` times what was
        not sent) only replaces the kept one once the step is committed."""
        ratio = topk_ratio_at(step, self.topk_ratio, self.topk_warmup_steps, self.topk_warmup_start)
        cs = list(self.chunk_sizes)
        if not self.error_feedback:
            if self.topk_scope == "global":
                return dict(zip(cs, topk_compress_global([grads[c] for c in cs], ratio, self.topk_groups))), {}
            return dict(zip(cs, topk_compress_many([grads[c] for c in cs], ratio))), {}
        ge = {c: grads[c].astype(jnp.float32) + self._residual.get(c, 0.0) for c in cs}
        if self.topk_scope == "global":
            comp = dict(zip(cs, topk_compress_global([ge[c] for c in cs], ratio, self.topk_groups)))
        else:
            comp = {c: topk_compress(ge[c], ratio) for c in cs}
        out, residual = {}, {}
        for c in cs:
            idx, vals = comp[c]
            if self.topk_scope == "global":  # on the host: the kept count varies per chunk and step
                vals = np.asarray(vals).astype(np.dtype(grads[c].dtype))  # (a jax scatter would recompile)
                r = np.array(ge[c], F32)
                r[np.asarray(idx, np.int64)] -= vals.astype(F32)
                if self.ef_decay != 1.0:
                    r *= np.float32(self.ef_decay)
            else:
                vals = jnp.asarray(vals).astype(grads[c].dtype)
                r = ge[c].at[jnp.asarray(idx)].add(-vals.astype(jnp.float32))
                r = r if self.ef_decay == 1.0 else r * jnp.float32(self.ef_decay)
            residual[c], out[c] = r, (idx, vals)
        return out, residual

    def _payload(self, c: int, g: jax.Array, compressed=None):
        """(wire message part, bytes) for chunk c's gradient (``compressed``: its top-k from
        :meth:`_compress`)."""
        if self.compression != "topk":
            a = np.asarray(g)
            a = a.view(np.uint16) if a.dtype == BF16 else a.astype(F32, copy=False)
            return ("dense", a), a.nbytes
        idx, vals = compressed
        idx, vals = np.asarray(idx), np.asarray(vals)
        vals = vals.view(np.uint16) if vals.dtype == BF16 else vals.astype(F32, copy=False)
        return ("topk", idx, vals), idx.nbytes + vals.nbytes

    @property
    def order(self) -> tuple[int, ...]:
        """The chunks in the order of the step begun last (each worker reads and updates its own
        chunks in this order; default: id order)."""
        return getattr(self, "_order", None) or tuple(self.chunk_sizes)

    def begin(self, order: Sequence[int] | None = None, *, norm_free: bool = False) -> None:
        """Start step ``committed_step + 1``: every worker starts reading its chunks' state (master,
        m, v) into its staging buffers, in ``order`` (a permutation of the chunk ids; default id
        order), before any gradient exists: up to ``n_buffers - 1`` chunks per worker are read
        ahead (the staging bound), the rest as the update frees buffers. :meth:`finish` ends it.

        Args:
          order: the chunks in the order their gradients will come (the backward's order).
          norm_free: the step's scalars do not depend on the gradient norm (no clipping:
            ``spec.max_grad_norm`` None), so they go with the header and each chunk updates as
            soon as its gradient arrives (:meth:`finish` with ``norm=None``).

        Raises:
          ValueError: ``order`` is not a permutation of the chunks, or ``norm_free`` with clipping.
          StorageError: a worker died or is not taking messages.
        """
        self._check_usable()
        if getattr(self, "_begun", None) is not None:
            raise StorageError(f"step {self._begun[0]} was begun and not finished: finish or abandon it first")
        order = tuple(self.chunk_sizes) if order is None else tuple(int(c) for c in order)
        if sorted(order) != sorted(self.chunk_sizes):
            raise ValueError(f"order must name every chunk once (0..{len(self.chunk_sizes) - 1}), got {order}")
        if norm_free and self.spec.max_grad_norm is not None:
            raise ValueError("norm_free: the spec clips by the global norm (max_grad_norm is set)")
        step = self._step + 1
        scalars = self._step_scalars(self._step, 0.0) if norm_free else None
        self._order = order
        for i in range(len(self.dirs)):
            self._send(i, ("step", step, order, scalars), f"starting step {step}")
        self._begun = (step, norm_free, time.perf_counter())

    def abandon(self) -> None:
        """End a begun step unwritten (the caller failed before its gradients or norm existed):
        every worker drops what it read or wrote of it and stays at the committed step."""
        begun, self._begun = getattr(self, "_begun", None), None
        if begun is None or self._broken:
            return
        self._stop_step(begun[0], "skip")

    def step(self, grads: Sequence, *, norm: float | None = None, on_param=None) -> StepResult:
        """One AdamW step of every chunk (:meth:`begin` then :meth:`finish`).

        Args:
          grads: per chunk c, the (n_c,) gradient (jax or numpy; bfloat16 or float32).
          norm: the global L2 norm of the whole model's gradient (float32), when the caller knows
            it (a step whose other chunks are updated elsewhere: :mod:`chunkjax.storage.updater`);
            None: the norm of ``grads``.
          on_param: ``on_param(c, bits)`` takes chunk c's new params ((n_c,) uint16 bf16 bits) as
            they arrive; ``StepResult.params`` is then None.

        Returns:
          :class:`StepResult` with the new bf16 params per chunk and the byte accounting.

        Raises:
          StorageError: a worker died, timed out or failed (e.g. its disk is full). The step is not
            committed; after a dead worker this object is unusable (open a new one to resume).
        """
        self._check_usable()
        grads, norm = self._check_grads(grads) if norm is None else (self._check_sizes(grads), norm)
        if not math.isfinite(norm):
            return StepResult(self._step, None, True, norm, n_params=self.n_params, emulated=self.link_model.emulated)
        self.begin()
        return self.finish(dict(enumerate(grads)), norm=norm, on_param=on_param)

    def finish(self, grads, *, norm: float | None = None, on_param=None, on_params_in=None) -> StepResult:
        """End the step :meth:`begin` started: send the scalars (unless the step is norm-free) and
        every chunk's gradient, take the new params back, commit.

        Args:
          grads: ``{c: (n_c,) gradient}``, sent in :attr:`order`; or an iterable of ``(c,
            gradient)`` pairs, sent as they come (it may block until the caller has the next
            gradient: the workers update each chunk once its gradient and the scalars are there).
          norm: the global gradient norm (float32) of a step begun with clipping; a non-finite
            norm skips the step (nothing changes; nothing of ``grads`` is read). None for a
            norm-free step.
          on_param: as in :meth:`step`.
          on_params_in: ``on_params_in()`` once every chunk's params are back, before the workers'
            last writes and the commit end.

        Returns and raises: as :meth:`step`; with top-k compression ``grads`` must be a dict.
        """
        begun = getattr(self, "_begun", None)
        if begun is None:
            raise StorageError("finish without begin: call begin() first")
        step, norm_free, t0 = begun
        if (norm is None) != norm_free:
            self.abandon()
            raise ValueError("pass norm exactly when the step was begun without norm_free")
        n = len(self.dirs)
        if not norm_free:
            if not math.isfinite(norm):  # a non-finite step changes no state
                self.abandon()
                return StepResult(self._step, None, True, norm, n_params=self.n_params,
                                  emulated=self.link_model.emulated)
            scale, hyper = self._step_scalars(self._step, norm)
            for i in range(n):
                self._send(i, ("scalars", step, (scale, hyper)), f"starting step {step}")
        self._begun = None
        sent = 0
        batched, residual = {}, {}
        if self.compression == "topk":  # one batched top-k per size (or one global one)
            if not isinstance(grads, dict):
                raise self._fail("top-k compression needs every gradient at once: pass a dict")
            try:
                batched, residual = self._compress([grads[c] for c in self.chunk_sizes], step)
            except BaseException as e:  # the workers wait for these gradients: stop them
                raise self._fail(f"compressing the gradients of step {step} failed ({type(e).__name__}: {e})") \
                    from e
        progress: dict = {"at": time.monotonic()}
        sending = self._sender.submit(self._send_grads, grads, batched, step, progress)
        params, storage, received, failure = self._collect(step, on_param, sending, progress, on_params_in)
        if failure is None:
            sent = sending.result()
        if failure is None and progress.get("skipped"):  # the caller ended the step: nothing was committed
            for i in set(range(n)) - progress.get("stopped", set()):  # prepared before the skip came
                while self._expect_any(i, f"ending step {step} unwritten")[0] not in ("skipped", "aborted"):
                    pass
            return StepResult(self._step, None, True, float("nan"), n_params=self.n_params,
                              emulated=self.link_model.emulated)
        if failure is not None:
            if not self._broken:  # a worker reported an error (e.g. a full disk): abort the others
                with contextlib.suppress(StorageError, OSError, EOFError):
                    self._stop_step(step, "abort")
            raise failure
        residual_bytes = 0
        if residual:  # error feedback: the residuals of this step on storage before anyone commits it
            try:
                residual_bytes = self._save_residual(step, residual)
            except StorageError:
                with contextlib.suppress(StorageError, OSError, EOFError):
                    self._stop_step(step, "abort")
                raise
        for i in range(n):
            self._send(i, ("commit", step), f"committing step {step}")
        for i in range(n):
            self._expect(i, "committed", f"committing step {step}")
        self._step = step
        if residual:
            self._residual = residual
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._residual_path(step - 1))
        return StepResult(step, None if on_param is not None else [params[c] for c in self.chunk_sizes], False, norm,
                          sent + received, sent, received,
                          storage, time.perf_counter() - t0, self.n_params, self.link_model.emulated,
                          residual_bytes, progress.get("ahead", 0), progress.get("read", {}),
                          progress.get("written", {}))

    def read_state(self) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``{c: (master, m, v)}`` float32 copies at the committed step, read by the workers."""
        self._check_usable()
        out = {}
        for i in range(len(self.dirs)):
            self._send(i, ("read",), "reading state")
            out.update(self._expect(i, "state", "reading state")[1])
        return dict(sorted(out.items()))

    def close(self):
        """Stop the workers (committed state stays on storage)."""
        for i in range(len(getattr(self, "_conns", []))):
            if self.workers[i].is_alive() and not self._broken:
                with contextlib.suppress(StorageError):
                    self._send(i, ("close",), "closing")
        for p in getattr(self, "workers", []):
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        self._kill_all()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


