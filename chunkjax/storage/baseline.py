"""The ZeRO-Infinity-style baseline of the storage tier: the update on the host, the state on storage.

Smart-Infinity (Jang et al., HPCA 2024, arXiv 2403.06664) compares SmartUpdate against
ZeRO-Infinity's NVMe offload, where every step reads the fp32 master params and moments of each
chunk from storage into host staging buffers, updates them on the host and writes them back: every
state byte crosses the shared host <-> storage link twice. Same kernels and scalars as the host
tier and the near-storage workers (:mod:`chunkjax.kernels`).
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence

import ml_dtypes
import numpy as np

from chunkjax.kernels import BF16_BITS_DTYPE, AdamW, update_
from chunkjax.storage.files import StorageError
from chunkjax.storage.links import LinkModel
from chunkjax.storage.tier import DiskTier
from chunkjax.storage.trainer import StepResult, TierTrainer, validate_storage_dirs
from chunkjax.storage.worker import _bits_or_f32

BF16 = np.dtype(ml_dtypes.bfloat16)


class BaselineOptimizer(TierTrainer):
    """AdamW with the state on storage, updated on the host (the ZeRO-Infinity baseline that
    Smart-Infinity compares against): each step reads master, m, v of every chunk from storage into
    the host staging buffers, updates them on the host and writes them back, so every state byte
    crosses the shared host <-> storage link twice (>= 24 bytes/param/step; the gradient itself is
    already on the host and is not counted on that link).

    Args: as :class:`chunkjax.storage.near.NearStorageOptimizer` (no compression); ``io_threads`` I/O threads (default
    2 per directory) and ``n_buffers`` staging buffers (default n_dirs + 2, so that a write per
    directory can be in flight: 1.13 s against 1.46 s with 3 buffers for 4 directories under an
    emulated 3 MB/s per directory, 16 MB/s shared, where the bound is 1.05 s) in this process.
    With a ``link_model``, ``shared_bytes_per_s`` throttles all storage traffic together and
    ``disk_bytes_per_s`` each directory.
    """

    def __init__(self, dirs: Sequence[str], chunk_sizes, spec: AdamW, *, init_params=None,
                 link_model: LinkModel | None = None, io_mode: str = "auto", n_buffers: int | None = None,
                 io_threads: int | None = None, fsync: bool = True):
        validate_storage_dirs(dirs)
        self._init_common(chunk_sizes, spec, link_model)
        n = len(dirs)
        self.tier = DiskTier(dirs, self.chunk_sizes, n_buffers=n_buffers or n + 2, io_threads=io_threads or 2 * n,
                             io_mode=io_mode, link_model=self.link_model, fsync=fsync)
        self.dirs = self.tier.dirs
        if self.tier.committed_step is None:
            if init_params is None:
                raise StorageError(f"{self.dirs} hold no committed run: pass init_params")
            self.tier.initialize(init_params)

    @property
    def committed_step(self) -> int:
        return self.tier.committed_step

    def step(self, grads: Sequence) -> StepResult:
        """One AdamW step of every chunk, on the host; arguments and result as
        :meth:`NearStorageOptimizer.step`. Raises StorageError (e.g. a full disk; nothing committed)."""
        grads, norm = self._check_grads(grads)
        count = self.tier.committed_step
        if not math.isfinite(norm):
            return StepResult(count, None, True, norm, n_params=self.n_params, emulated=self.link_model.emulated)
        t0 = time.perf_counter()
        scale, hyper = self._step_scalars(count, norm)
        host = [np.asarray(g) for g in grads]
        params = {}

        def fn(c, views):
            out = np.empty(views[0].size, BF16_BITS_DTYPE)
            update_(hyper, views[0], views[1:], np.ascontiguousarray(_bits_or_f32(host[c])), out, scale)
            params[c] = out.view(BF16)

        io = self.tier.update(fn)
        storage = {d: io.read[d] + io.written[d] for d in io.read}
        total = sum(storage.values())
        return StepResult(self.tier.committed_step, [params[c] for c in self.chunk_sizes], False, norm, total,
                          sum(io.read.values()), sum(io.written.values()), storage, time.perf_counter() - t0,
                          self.n_params, self.link_model.emulated, storage_read_bytes=dict(io.read),
                          storage_written_bytes=dict(io.written))

    def read_state(self):
        return {c: self.tier.read_chunk(c) for c in self.chunk_sizes}

    def close(self):
        self.tier.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
