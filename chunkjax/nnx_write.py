"""Writing the drop-in optimizer's new params into an NNX model without a graph traversal.

``nnx.update(model, state)`` walks the whole module graph and the state together (about 13 ms
per call for the 387 leaves of ``shared/probes/nnx_dropin_probe.py``'s decoder on a 2-core CPU,
plus 3 ms to build the ``nnx.State``): that is per step, after the update, while the device waits
for the next gradient step. :class:`chunkjax.NnxOptimizer` instead keeps, from construction, each
leaf's path in the model, and each call looks the variables up along those paths and sets their
values (:func:`write`); where a path no longer leads to a plain variable holding a ``jax.Array``
(the user replaced a submodule, a variable is a hijax or array-ref variable) nothing is written
and the caller falls back to ``nnx.update``. Looking the variables up on every call (rather than
keeping the objects) writes into whatever variable the model holds now, as ``nnx.update`` does.
"""
from __future__ import annotations

import jax


def _key(k):
    for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
        if hasattr(k, attr):
            return getattr(k, attr)
    raise TypeError(f"unknown pytree key {k!r}")


def variable_paths(state) -> list[tuple] | None:
    """Per leaf of ``state`` (``nnx.state(model, wrt)``: a state of the model's variables), in
    ``jax.tree_util`` flatten order, the path of its variable in the model (attribute names,
    list indices, dict keys). None if the state does not flatten into one ``.value`` leaf per
    variable (another flax version): then :func:`write` is never used."""
    try:
        flat, _ = jax.tree_util.tree_flatten_with_path(state)
        paths = []
        for path, _leaf in flat:
            if not path or _key(path[-1]) != "value":
                return None
            paths.append(tuple(_key(k) for k in path[:-1]))
    except TypeError:
        return None
    return paths


def _lookup(model, path):
    node = model
    for k in path:
        node = getattr(node, k) if isinstance(k, str) and hasattr(node, k) else node[k]
    return node


def write(model, paths: list[tuple] | None, leaves: list) -> bool:
    """Set the variable at each ``paths[i]`` of ``model`` to ``leaves[i]`` (a ``jax.Array``).

    Returns:
      True once every value is set; False with nothing written if ``paths`` is None or a path
      does not lead to a plain (not hijax, not array-ref) ``nnx.Variable`` holding a
      ``jax.Array`` (then use ``nnx.update``).
    """
    from flax import nnx
    if paths is None or len(paths) != len(leaves):
        return False
    found = []
    for path in paths:
        try:
            v = _lookup(model, path)
        except (AttributeError, KeyError, IndexError, TypeError):
            return False
        if (not isinstance(v, nnx.Variable) or getattr(v, "hijax", False) or getattr(v, "ref", False)
                or not isinstance(v.get_raw_value(), jax.Array)):
            return False
        found.append(v)
    for v, x in zip(found, leaves):
        v.set_raw_value(x)
    return True
