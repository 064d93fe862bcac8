"""chunkjax: chunk-based heterogeneous memory management for training transformers in JAX.

A JAX reimplementation of PatrickStar (chunks placed by the memory tide) and Smart-Infinity
(storage-offloaded optimizer updates). The data flows one way::

    layout (pytree -> chunks) -> trace (non-model bytes per stage) -> tide (bytes per moment)
        -> schedule (placement, fetches/evictions, update locations, programs, predictions)
        -> runtime (jitted programs + host-update thread) -> optim / host_update (the update per chunk)

``zero_schedule`` runs the schedule with every chunk sharded over a data mesh (ZeRO stages 1-3
with XLA collectives, host updates per rank shard); ``zero`` is the one-program ZeRO step that
also runs across processes (docs/multihost.md).
"""
from chunkjax.checkpoint import (AsyncSave, CheckpointError, CheckpointWriteError, export_params, latest_step,
                                 restore_checkpoint, save_checkpoint, save_checkpoint_async)
from chunkjax.flax_api import ChunkedOptimizer, NnxOptimizer
from chunkjax.layout import ChunkLayout, LeafSlot, build_layout, first_use_order, search_chunk_size
from chunkjax.loss_scale import DynamicLossScale
from chunkjax.memory import DEVICE, PINNED_HOST
from chunkjax.optim import init_chunk_state, update_chunk
from chunkjax.plan import (Accounting, ChunkBytes, Placement, PlanError, StageTrace, account, chunk_bytes,
                           parse_bytes, plan_fixed)
from chunkjax.runtime import ChunkedStep, TrainState, make_chunked_step
from chunkjax.schedule import Schedule, plan_schedule
from chunkjax.stages import Stage, compose_loss
from chunkjax.trace import trace_stages
from chunkjax.zero import build_zero_layout, data_mesh
from chunkjax.zero_schedule import ZeroScheduledStep, make_zero_scheduled_step, plan_zero_schedule

__all__ = [
    "CheckpointError", "CheckpointWriteError", "export_params", "latest_step", "restore_checkpoint", "save_checkpoint",
    "save_checkpoint_async", "AsyncSave",
    "Accounting", "ChunkBytes", "ChunkLayout", "ChunkedStep", "DEVICE", "LeafSlot", "PINNED_HOST", "Placement",
    "PlanError", "Schedule", "Stage", "StageTrace", "TrainState", "account", "build_layout", "chunk_bytes", "compose_loss",
    "first_use_order", "init_chunk_state", "make_chunked_step", "parse_bytes", "plan_fixed", "plan_schedule", "search_chunk_size",
    "trace_stages", "update_chunk",
    "ChunkedOptimizer", "NnxOptimizer", "DynamicLossScale",
    "ZeroScheduledStep", "build_zero_layout", "data_mesh", "make_zero_scheduled_step", "plan_zero_schedule",
]
