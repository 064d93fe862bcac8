"""Frozen parameters and integer leaves (issue 22 item 2): chunks grouped by (dtype, trainable)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkjax as cj
from chunkjax.topology import build_zero_layout


def _tree():
    return {"emb": jnp.ones((64, 8), jnp.float32), "ids": jnp.arange(16, dtype=jnp.int32),
            "w": jnp.ones((8, 8), jnp.float32), "mask": jnp.ones((4,), jnp.bool_),
            "b": jnp.ones((8,), jnp.bfloat16)}


def test_default_freezes_integer_and_bool_leaves_in_their_own_chunks():
    lay = cj.build_layout(_tree(), 512)
    assert len(lay.chunk_trainable) == lay.n_chunks
    for s in lay.slots:
        assert lay.chunk_trainable[s.chunk] == bool(jnp.issubdtype(s.dtype, jnp.floating)), s.path


def test_trainable_tree_never_mixes_frozen_and_trainable_leaves():
    t = _tree()
    mark = {"emb": False, "ids": False, "w": True, "mask": False, "b": True}
    lay = cj.build_layout(t, 1024, trainable=mark)
    by_path = {s.path: s for s in lay.slots}
    assert by_path["emb"].chunk != by_path["w"].chunk  # same dtype, different trainability
    for p, tr in mark.items():
        assert lay.chunk_trainable[by_path[p].chunk] == tr
    back = lay.unpack(lay.pack(t))
    for k in t:
        assert back[k].dtype == t[k].dtype and np.array_equal(back[k], t[k])
    z = build_zero_layout(t, 8, 1000, trainable=mark)
    assert z.chunk_size % 8 == 0 and z.chunk_trainable == lay.chunk_trainable
    assert cj.search_chunk_size(t, trainable=mark) >= 512


def test_old_callers_get_all_trainable_and_bad_marks_are_refused():
    lay = cj.build_layout({"w": jnp.ones((4,))}, 128)
    assert lay.chunk_trainable == (True,)
    with pytest.raises(ValueError, match="ids.*cannot be trainable"):
        cj.build_layout(_tree(), 512, trainable={**{k: True for k in _tree()}})
    with pytest.raises(ValueError, match="True or False"):
        cj.build_layout(_tree(), 512, trainable={k: 1 for k in _tree()})
    with pytest.raises(ValueError, match="structure"):
        cj.build_layout(_tree(), 512, trainable={"w": True})
    with pytest.raises(ValueError, match="chunk_trainable"):
        cj.ChunkLayout(treedef=lay.treedef, slots=lay.slots, chunk_size=128, chunk_dtypes=lay.chunk_dtypes,
                       chunk_trainable=(True, False))
