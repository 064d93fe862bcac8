"""The storage tier: optimizer state on storage devices, updated next to them (Smart-Infinity).

Smart-Infinity (Jang et al., HPCA 2024, arXiv 2403.06664) keeps the fp32 optimizer state on
storage and runs the update next to each storage device (SmartUpdate), with top-k gradient
compression; ZeRO-Infinity's NVMe offload is the baseline. One module per concept, data flowing
one way (docs/storage.md):

* :mod:`~chunkjax.storage.links`: the emulated bandwidth model (:class:`LinkModel`, :class:`Link`);
* :mod:`~chunkjax.storage.files`: the chunk files of one directory (format, CRC-32 checksums,
  manifest, crash-safe commit; :class:`StorageError`);
* :mod:`~chunkjax.storage.tier`: :class:`DiskTier`, the directories with the staging-buffer pool;
* :mod:`~chunkjax.storage.worker`: the near-storage worker process (AdamW of
  :mod:`chunkjax.kernels` next to its directory);
* :mod:`~chunkjax.storage.topk`: top-k gradient compression (jax, on the trainer);
* :mod:`~chunkjax.storage.trainer`: what the trainer side of both optimizers shares;
* :mod:`~chunkjax.storage.near`: :class:`~chunkjax.storage.near.NearStorageOptimizer` (SmartUpdate);
* :mod:`~chunkjax.storage.baseline`: :class:`~chunkjax.storage.baseline.BaselineOptimizer`.

This package re-exports the disk tier's names, which import numpy only (a worker process imports
no jax); the optimizers are imported from their modules.
"""
from chunkjax.storage.files import (ADAM_KINDS, ALIGN, STATE_DTYPE, StorageError, chunk_file_name, committed_step,
                                    read_manifest, replace_file, section_bytes)
from chunkjax.storage.links import Link, LinkModel
from chunkjax.storage.tier import DiskTier, StepIO

__all__ = ["ADAM_KINDS", "ALIGN", "STATE_DTYPE", "DiskTier", "Link", "LinkModel", "StepIO", "StorageError",
           "chunk_file_name", "committed_step", "read_manifest", "replace_file", "section_bytes"]
