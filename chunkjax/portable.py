"""One chunk's optimizer state in the portable form of a checkpoint, and back.

The portable form (:mod:`chunkjax.checkpoint.protocol`) holds per chunk the step count, one
(chunk_size,) float32 array per per-element moment, named by the optax field (``mu``, ``nu`` for
Adam/AdamW, ``mu`` for Lion, ``trace`` for SGD with momentum), and the scalars of optax's
*rest-of-model* leaf (:mod:`chunkjax.optim`). This module converts an optax chunk state
(:func:`chunkjax.optim.init_chunk_state`) and a host state (``Host*State`` of
:mod:`chunkjax.host_update`) to it and back; the engines (:mod:`chunkjax.step_checkpoint`,
:mod:`chunkjax.flax_api`) use it to implement the checkpoint protocol.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from chunkjax.checkpoint.protocol import CheckpointError


def optax_leaf_role(path) -> tuple[str, int | None]:
    """(field name, index) of an optax state leaf of a chunk: ``("count", None)``, or
    ``("mu", 0)`` for the chunk's moment and ``("mu", 1)`` for the rest-of-model leaf's."""
    name, idx = None, None
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            name, idx = k.name, None
        elif isinstance(k, jax.tree_util.DictKey):
            name, idx = str(k.key), None
        elif isinstance(k, jax.tree_util.SequenceKey) and name is not None:
            idx = k.idx
    return name, idx


def optax_to_portable(opt_state, chunk_size: int) -> tuple[int | None, dict, dict]:
    """Split one chunk's optax state into (count, {moment: (chunk_size,) float32 numpy},
    {moment: rest-leaf float}).

    Raises:
      CheckpointError: a leaf that is neither a step count nor a per-element moment (e.g. a
        transformation with non-elementwise state), two moments of one name, or step counts that
        disagree.
    """
    counts, moments, rest = set(), {}, {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        name, idx = optax_leaf_role(path)
        shape = tuple(np.shape(leaf))
        where = jax.tree_util.keystr(path)
        if name == "count" and shape == ():
            counts.add(int(np.asarray(leaf)))
        elif name is not None and idx == 0 and shape == (chunk_size,):
            if name in moments:
                raise CheckpointError(f"optax state has two moments named {name!r} (at {where}): a chain of two "
                                      "stateful optimizers has no per-chunk checkpoint form")
            moments[name] = host_value(leaf, np.float32)
        elif name is not None and idx == 1 and shape == ():
            rest[name] = float(np.asarray(leaf))
        else:
            raise CheckpointError(f"optax state leaf {where} (shape {shape}) is neither a step count nor a "
                                  "per-element moment: only elementwise optimizers (Adam/AdamW/Lion/SGD) are supported")
    if len(counts) > 1:
        raise CheckpointError(f"optax state holds differing step counts {sorted(counts)}")
    return (counts.pop() if counts else None), moments, rest


def portable_to_optax(template, count: int | None, moments: dict, rest: dict, chunk: int):
    """Fill the structure ``template`` (``jax.eval_shape`` of the chunk's optax init) with saved
    values as numpy arrays. Raises CheckpointError if the moment names differ."""
    check_optax_moments(template, moments, chunk)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    out = []
    for path, leaf in leaves:
        name, idx = optax_leaf_role(path)
        if name == "count" and leaf.shape == ():
            out.append(np.asarray(0 if count is None else count, leaf.dtype))
        elif idx == 0 and leaf.ndim == 1:
            out.append(np.asarray(moments[name], leaf.dtype))
        elif idx == 1 and leaf.shape == ():
            out.append(np.asarray(rest.get(name, 0.0), leaf.dtype))
        else:
            raise CheckpointError(f"this step's optax state leaf {jax.tree_util.keystr(path)} (shape {leaf.shape}) "
                                  "has no checkpoint form: only elementwise optimizers are supported")
    return jax.tree_util.tree_unflatten(treedef, out)


def check_optax_moments(template, names, chunk: int) -> None:
    """Raise a one-line CheckpointError if chunk ``chunk``'s optax state ``template`` has other
    per-element moments than ``names``."""
    need = sorted(moment_names(template))
    if need != sorted(names):
        raise CheckpointError(f"chunk {chunk}: the checkpoint's optimizer moments {sorted(names)} do not match "
                              f"this step's optax state {need}: restore with the optimizer the checkpoint was saved "
                              "with")


def host_to_portable(st) -> tuple[int, dict]:
    """``(count, {moment: (chunk_size,) float32 numpy})`` of a ``Host*State`` (its own arrays, not
    copies). Raises CheckpointError for a host state without a checkpoint form."""
    table = host_moments().get(type(st))
    if table is None:
        raise CheckpointError(f"host optimizer state {type(st).__name__} has no checkpoint form "
                              f"(supported: {', '.join(t.__name__ for t in host_moments())})")
    return int(st.count), {name: getattr(st, field) for field, name in table}


def portable_to_host(cls, count: int | None, moments: dict, chunk: int):
    """A ``cls`` host state (``Host*State``) holding ``count`` and the float32 ``moments``.
    Raises CheckpointError if the moment names do not fit ``cls``."""
    check_host_moments(cls, moments, chunk)
    table = host_moments()[cls]
    kw = {field: np.require(moments[name], np.float32, ["C", "W", "O"]) for field, name in table}
    return cls(count=0 if count is None else int(count), **kw)


def check_host_moments(cls, names, chunk):
    """Raise a one-line CheckpointError if the host state class ``cls`` cannot take ``names``."""
    table = host_moments().get(cls)
    if table is None:
        raise CheckpointError(f"host optimizer state {cls.__name__} has no checkpoint form")
    need = sorted(n for _, n in table)
    if sorted(names) != need:
        raise CheckpointError(f"chunk {chunk}: the checkpoint's optimizer moments {sorted(names)} cannot restore "
                              f"into {cls.__name__} (needs {need}): restore with the optimizer it was saved with")


def is_host_state(st) -> bool:
    """True for a ``Host*State`` (a dataclass instance), False for an optax state."""
    return dataclasses.is_dataclass(st) and not isinstance(st, type)


def moment_names(st) -> list[str]:
    """The per-element moment names of a chunk's optax or host state."""
    if is_host_state(st):
        return [name for _, name in host_moments()[type(st)]]
    return [optax_leaf_role(p)[0] for p, l in jax.tree_util.tree_flatten_with_path(st)[0]
            if optax_leaf_role(p)[1] == 0 and np.ndim(l) == 1]


def host_value(a, dtype=None) -> np.ndarray:
    """``np.asarray(a, dtype)`` without leaving the host copy cached on ``a``: jax keeps
    np.asarray's device -> host copy on the jax.Array for the array's lifetime, which would hold
    every saved device chunk in host memory until the state is donated. A temporary Array over
    the same device buffers takes the cache and is dropped with it."""
    if isinstance(a, jax.Array) and not a.is_deleted():
        a = jax.make_array_from_single_device_arrays(a.shape, a.sharding, [s.data for s in a.addressable_shards])
    return np.asarray(a, dtype)


def numpy_leaves(x) -> list[np.ndarray]:
    """The numpy arrays inside tuples, lists, dicts and dataclasses (host optimizer states)."""
    if isinstance(x, np.ndarray):
        return [x]
    if isinstance(x, (tuple, list)):
        return [a for v in x for a in numpy_leaves(v)]
    if isinstance(x, dict):
        return [a for v in x.values() for a in numpy_leaves(v)]
    if is_host_state(x):
        return [a for f in dataclasses.fields(x) for a in numpy_leaves(getattr(x, f.name))]
    return []


@functools.cache
def host_moments() -> dict:
    """Host state dataclass -> ((host field, optax moment name), ...). The optax names are the
    field names of optax's states: ScaleByAdamState.mu/nu, ScaleByLionState.mu, TraceState.trace.
    (chunkjax.host_update, which loads numba, is imported on first use only.)"""
    from chunkjax import host_update as hu
    return {hu.HostAdamState: (("m", "mu"), ("v", "nu")),
            hu.HostLionState: (("m", "mu"),),
            hu.HostMomentumState: (("trace", "trace"),)}

