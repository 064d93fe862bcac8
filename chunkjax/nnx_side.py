"""The NNX model's non-parameter state in a drop-in checkpoint (:class:`chunkjax.NnxOptimizer`).

A drop-in checkpoint saves the optimizer's chunks (master params, moments, step count), but an
NNX training loop also changes variables that are not trained: dropout RNG counts
(``nnx.RngCount``), RNG keys, BatchNorm statistics (``nnx.BatchStat``), user counters (any
``nnx.Variable`` outside ``wrt``). Without them a resumed run draws other dropout masks and
normalises with other statistics: not bit-exact. :class:`chunkjax.NnxOptimizer` keeps a
reference to its model (the last one given to it), so ``save_checkpoint(dir, n, opt)`` puts the
model's state outside ``wrt`` into ``meta.json`` as ``side_state`` (``{"keys": [leaf path, ...],
"values": [array, ...]}``, arrays as :mod:`chunkjax.checkpoint.codec` writes them: the front
door's format, :mod:`chunkjax.front_checkpoint`), and ``restore_checkpoint(dir, opt)`` writes it
back into the model (checked first: keys, shapes, dtypes; one-line CheckpointError naming the
first that differs, nothing changed).
"""
from __future__ import annotations

import warnings

import jax
import numpy as np

from chunkjax.checkpoint.codec import decode, encode
from chunkjax.checkpoint.protocol import CheckpointError

#: The meta.json entry of the non-parameter state (the front door's name).
SIDE_STATE = "side_state"


def _state(model, wrt):
    from flax import nnx
    return nnx.state(model, nnx.Not(wrt))


def _flat(model, wrt):
    """(keys, values, treedef, state) of the model's variables outside ``wrt`` (leaf order)."""
    state = _state(model, wrt)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    keys = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in flat]
    return keys, [v for _, v in flat], treedef


def side_entry(model, wrt) -> dict:
    """``{"side_state": {"keys": [...], "values": [...]}}``: the meta.json entry of ``model``'s
    variables outside ``wrt`` (arrays copied into the JSON now). Raises a one-line TypeError
    naming a leaf that cannot be saved."""
    keys, values, _ = _flat(model, wrt)
    return {SIDE_STATE: {"keys": keys, "values": encode(list(values), SIDE_STATE)}}


def _spec(v):
    if isinstance(v, (jax.Array, np.ndarray, np.generic)):
        return tuple(np.shape(v)), str(v.dtype)
    return (), type(v).__name__


def saved_side(model, wrt, saved) -> list | None:
    """The checkpoint's non-parameter state as ``model``'s leaves (in its leaf order), checked
    against the model's (keys, shapes, dtypes); None if the checkpoint holds none (an older
    drop-in checkpoint, or a ChunkedOptimizer's: a RuntimeWarning says the model keeps its own
    when it has such state). Raises a one-line CheckpointError naming the first difference."""
    keys, now, _ = _flat(model, wrt)
    entry = saved.meta.get(SIDE_STATE)
    if entry is None:
        if keys:
            warnings.warn(f"{saved.where} holds no non-parameter state (saved from a "
                          f"{saved.meta.get('saved_from', {}).get('step', '?')}): the model keeps its own "
                          f"({keys[0]!r}, ... {len(keys)} leaves), so dropout masks / batch statistics may differ "
                          "from the uninterrupted run", RuntimeWarning, stacklevel=4)
        return None
    by_key = side_by_key(saved, entry, keys, "which this model does not have")
    out = []
    for k, v in zip(keys, now):
        got = by_key[k]
        if _spec(got) != _spec(v):
            raise CheckpointError(f"non-parameter state {k!r} is {_spec(got)} in {saved.where} but {_spec(v)} in this "
                                  "model: restore a checkpoint of this model")
        out.append(got)
    return out


def side_by_key(saved, entry: dict, keys: list, unknown: str) -> dict:
    """A checkpoint's non-parameter state (``entry``, its ``side_state``) by key, once its keys
    are checked to be ``keys``; a one-line CheckpointError names the first key only one side
    has (``unknown``: how the model is said not to hold a key of the checkpoint)."""
    got_keys, values = list(entry["keys"]), list(decode(entry["values"]))
    for k in got_keys:
        if k not in keys:
            raise CheckpointError(f"{saved.where} holds non-parameter state {k!r}, {unknown} "
                                  f"({len(got_keys)} vs {len(keys)} leaves): restore a checkpoint of this model")
    for k in keys:
        if k not in got_keys:
            raise CheckpointError(f"non-parameter state {k!r} of this model is not in {saved.where} "
                                  f"({len(got_keys)} vs {len(keys)} leaves): restore a checkpoint of this model")
    return dict(zip(got_keys, values))


def write_side(model, wrt, values: list) -> None:
    """Set ``model``'s variables outside ``wrt`` to ``values`` (:func:`saved_side`'s), on the
    device each was on (arrays) and committed like the optimizer's params."""
    from flax import nnx

    from chunkjax.memory import DEVICE, sharding
    _, now, treedef = _flat(model, wrt)
    placed = [jax.device_put(v, sharding(DEVICE)) if isinstance(n, jax.Array) else v for v, n in zip(values, now)]
    nnx.update(model, treedef.unflatten(placed))
