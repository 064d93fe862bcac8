"""chunkjax: chunk-based heterogeneous memory management for training transformers in JAX.

A JAX reimplementation of PatrickStar (chunks placed by the memory tide) and Smart-Infinity
(storage-offloaded optimizer updates). The data flows one way::

    layout (pytree -> chunks) -> trace (non-model bytes per stage) -> tide (bytes per moment)
        -> plan (``plan_schedule``: one planner, policies tide / fixed / all_host / zero_offload /
           optimizer_only, ZeRO ranks) -> schedule (placement, fetches/evictions, update locations,
           programs; its prediction from ``predict``, the one accounting)
        -> step (walker + topology: jitted programs, host-update thread) -> updaters (the update
           per chunk and location: optim on the device, host_update on the host; its float32
           arithmetic is ``kernels``, shared with the storage tier ``storage``)

One step class, :class:`ChunkedStep`, runs on one device or over a ``data`` mesh with ZeRO stage
1/2/3 (``make_chunked_step(..., mesh=data_mesh(), zero_stage=3)``), in one process or across
processes through ``jax.distributed`` (docs/multihost.md).
"""
import importlib
import importlib.util

#: public name -> the module that defines it. Imported on first use (PEP 562), so that
#: ``import chunkjax.storage.worker`` (a near-storage worker process) does not pull in jax, flax
#: and orbax.
_EXPORTS = {
    **dict.fromkeys(["AsyncSave", "CheckpointError", "CheckpointWriteError", "export_params", "latest_step",
                     "restore_checkpoint", "save_checkpoint", "save_checkpoint_async"], "checkpoint"),
    "ChunkedOptimizer": "flax_api",
    "NnxOptimizer": "nnx_optimizer",
    **dict.fromkeys(["FitReport", "fit_step"], "fit"),
    **dict.fromkeys(["OffloadedStep", "offload", "plan_offload"], "front"),
    "OffloadPlan": "offload_plan",
    "HostMemoryError": "host_memory",
    **dict.fromkeys(["ChunkLayout", "LeafSlot", "Piece", "build_layout", "first_use_order", "search_chunk_size"], "layout"),
    "DynamicLossScale": "loss_scale",
    "WeightedLoss": "loss_weight",
    **dict.fromkeys(["DEVICE", "PINNED_HOST"], "memory"),
    "NonFiniteError": "nonfinite",
    "PartialStepError": "step_commit",
    **dict.fromkeys(["init_chunk_state", "update_chunk"], "optim"),
    "PlanError": "errors",
    "parse_bytes": "budget",
    "plan_schedule": "plan",
    "ReleasedParamsError": "released",
    **dict.fromkeys(["ChunkBytes", "chunk_bytes"], "predict"),
    **dict.fromkeys(["ChunkedStep", "TrainState", "make_chunked_step"], "step"),
    **dict.fromkeys(["Placement", "Prediction", "Schedule"], "schedule"),
    "NearStorageOptimizer": "storage.near",
    "StorageOptions": "storage.updater",
    **dict.fromkeys(["Stage", "compose_loss"], "stages"),
    **dict.fromkeys(["StageTrace", "trace_stages"], "trace"),
    **dict.fromkeys(["build_zero_layout", "data_mesh"], "topology"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """A public name (imported from its module on first use) or a submodule (``chunkjax.checkpoint``)."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f"chunkjax.{module}"), name)
        globals()[name] = value
        return value
    if importlib.util.find_spec(f"chunkjax.{name}") is not None:
        return importlib.import_module(f"chunkjax.{name}")
    raise AttributeError(f"module 'chunkjax' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
