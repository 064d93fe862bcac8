"""What the trainer side of the storage tier's optimizers shares: the step's result and accounting,
the gradient checks (global norm, non-finite), the step's scalars, and the validation of the
storage directories.

The step's scalars come from :mod:`chunkjax.kernels` (:func:`~chunkjax.kernels.clip_scale` through
``spec.grad_scale`` and :func:`~chunkjax.kernels.step_hyper`), as for the host tier's
:func:`chunkjax.host_update.host_update_`: one spec gives the same bits on both tiers.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from chunkjax.host_update import learning_rate_at
from chunkjax.kernels import AdamW, AdamWStep, clip_scale, step_hyper
from chunkjax.storage.links import LinkModel

@dataclasses.dataclass
class StepResult:
    """What one optimizer step did.

    Attributes:
      step: the committed step after this call (unchanged when skipped).
      params: per chunk, the (n_c,) updated params in the compute dtype (ml_dtypes.bfloat16
        numpy arrays); None when skipped.
      skipped: True when the gradient was not finite (nothing was sent or changed).
      grad_norm: global L2 norm of the (uncompressed) gradient.
      shared_link_bytes: bytes on the shared link this step (see module docstring).
      shared_link_in / shared_link_out: its two directions (to storage side / back), bytes.
      storage_link_bytes: per storage directory, bytes read + written on its own link.
      update_s: wall seconds of the update phase, from the step's header (the workers' reads
        start: :meth:`~chunkjax.storage.near.NearStorageOptimizer.begin`) to the commit.
      n_params: parameters updated (for bytes per param).
      emulated: True when a LinkModel throttled the links (times are an emulation).
      residual_bytes: bytes of error-feedback residuals the trainer wrote to ``residual_dir``
        (not part of ``shared_link_bytes``).
      read_ahead_bytes: state bytes the workers had read into their staging buffers when the
        step's first message after the header came (the scalars or a gradient): the read-ahead,
        at most ``n_buffers - 1`` chunk files per worker.
      storage_read_bytes / storage_written_bytes: per storage directory, the two directions of
        ``storage_link_bytes``: bytes the chunk files' reads and writes completed (empty where not
        split, as for a skipped step).
    """

    step: int
    params: list | None
    skipped: bool
    grad_norm: float
    shared_link_bytes: int = 0
    shared_link_in: int = 0
    shared_link_out: int = 0
    storage_link_bytes: dict = dataclasses.field(default_factory=dict)
    update_s: float = 0.0
    n_params: int = 0
    emulated: bool = False
    residual_bytes: int = 0
    read_ahead_bytes: int = 0
    storage_read_bytes: dict = dataclasses.field(default_factory=dict)
    storage_written_bytes: dict = dataclasses.field(default_factory=dict)

    @property
    def shared_link_bytes_per_param(self) -> float:
        return self.shared_link_bytes / max(self.n_params, 1)

    @property
    def storage_link_bytes_per_param(self) -> float:
        return sum(self.storage_link_bytes.values()) / max(self.n_params, 1)


def _sizes_of(chunk_sizes) -> dict[int, int]:
    sizes = dict(chunk_sizes) if isinstance(chunk_sizes, Mapping) else dict(enumerate(chunk_sizes))
    if sorted(sizes) != list(range(len(sizes))):
        raise ValueError("chunk ids must be 0..n_chunks-1")
    return {int(c): int(n) for c, n in sorted(sizes.items())}


class TierTrainer:
    """The trainer-side part both storage optimizers share: chunk sizes, the gradient checks (global
    norm), the step scalars (:meth:`_step_scalars`)."""

    def _init_common(self, chunk_sizes, spec: AdamW, link_model: LinkModel | None):
        if not isinstance(spec, AdamW):
            raise ValueError(f"spec must be chunkjax.kernels.AdamW, got {type(spec).__name__}")
        self.spec = spec
        self.chunk_sizes = _sizes_of(chunk_sizes)
        self.n_params = sum(self.chunk_sizes.values())
        self.link_model = link_model or LinkModel()

    def _check_grads(self, grads):
        if len(grads) != len(self.chunk_sizes):
            raise ValueError(f"need {len(self.chunk_sizes)} gradient chunks, got {len(grads)}")
        out = []
        for c, g in enumerate(grads):
            g = jnp.asarray(g).reshape(-1)
            if g.size != self.chunk_sizes[c]:
                raise ValueError(f"gradient chunk {c} has {g.size} elements, chunk size is {self.chunk_sizes[c]}")
            out.append(g)
        # optax.global_norm: sqrt of the sum of per-leaf sums of squares, in leaf order.
        norm = float(jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in out)))
        return out, norm

    def _check_sizes(self, grads) -> list:
        """The gradients as given (no copy), each checked to have its chunk's size."""
        if len(grads) != len(self.chunk_sizes):
            raise ValueError(f"need {len(self.chunk_sizes)} gradient chunks, got {len(grads)}")
        for c, g in enumerate(grads):
            if int(np.prod(np.shape(g))) != self.chunk_sizes[c]:
                raise ValueError(f"gradient chunk {c} has {int(np.prod(np.shape(g)))} elements, chunk size is "
                                 f"{self.chunk_sizes[c]}")
        return list(grads)

    def _step_scalars(self, count: int, norm: float) -> tuple[tuple[np.float32, np.float32], AdamWStep]:
        """``(grad_scale, hyper)`` of the step taken at ``count`` with global gradient norm ``norm``:
        the clipping factors (:func:`~chunkjax.kernels.clip_scale`) and the float32 scalars
        (:func:`~chunkjax.kernels.step_hyper`), as the host tier computes them."""
        return (clip_scale(self.spec.max_grad_norm, norm),
                step_hyper(self.spec, count, learning_rate_at(self.spec.learning_rate, count)))


def validate_storage_dirs(dirs) -> None:
    """Check a list of storage directories (one per storage device) before any chunk file or
    worker: at least one, none empty (``""``), no two the same, each an existing directory or
    creatable, none a file (reported case 16: a bad offload target once failed deep inside the
    first step). Writability is tried, not read from permission bits (as root ``os.access``
    says yes to ``/proc``): a temporary directory is made and removed in each directory, or in
    the nearest existing parent of one that does not exist yet.

    Raises:
      ValueError: one line naming the directory and what to change.
    """
    if isinstance(dirs, (str, bytes, os.PathLike)):
        raise ValueError(f"dirs={os.fspath(dirs)!r}: pass a list of directories (one per storage device)")
    dirs = [os.fspath(d) for d in dirs]
    if not dirs:
        raise ValueError("no storage directories: pass one per storage device")
    for d in dirs:
        if not str(d).strip():
            raise ValueError(f"storage directory {d!r} is empty: give a directory path, e.g. storage=['/nvme/cj']")
    real = [os.path.realpath(d) for d in dirs]
    for i, r in enumerate(real):
        if r in real[:i]:
            raise ValueError(f"storage directory {dirs[i]!r} is given twice: give each storage device once")
    for d in dirs:
        if os.path.exists(d) and not os.path.isdir(d):
            raise ValueError(f"storage directory {d!r} is a file, not a directory: give a directory")
        probe = os.path.abspath(d)
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if not os.path.isdir(probe) or not _can_write(probe):
            why = "is a file, not a directory" if not os.path.isdir(probe) else "is not writable"
            where = why if probe == os.path.abspath(d) else f"cannot be created ({probe!r} {why})"
            raise ValueError(f"storage directory {d!r} {where}: give a directory this process can write")


def _can_write(directory: str) -> bool:
    """Whether a directory can be made (and removed again) in ``directory``."""
    import tempfile
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".chunkjax_probe_", dir=directory))
    except OSError:
        return False
    return True


