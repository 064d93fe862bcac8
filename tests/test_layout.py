"""Tests for chunkjax.layout: packing a pytree into fixed-size chunks (reported failures 6 and 7).

Every test draws fresh random inputs from seeded generators; comparisons that must be exact
compare bit patterns, never float values.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from chunkjax import (DEVICE, PINNED_HOST, Placement, Stage, build_layout, first_use_order, make_chunked_step,
                      search_chunk_size)
from chunkjax.layout import CHUNK_ALIGN_ELEMS
from chunkjax.memory import sharding
from models.gpt import get_config, loss_fn

BF16, F32 = jnp.bfloat16, jnp.float32

# awkward sizes, bf16 and f32 interleaved in tree order, some leaves 2-D / 3-D, one nested dict
MIXED_SPEC = {
    "a": ((1,), BF16),
    "b": ((7,), F32),
    "c": ((511,), BF16),
    "d": ((513,), F32),
    "e": ((10, 100), BF16),
    "f": ((4099,), F32),
    "g": {"x": ((3, 171), F32), "y": ((1000,), BF16), "z": ((2, 2, 2), F32)},
    "h": ((1, 4097), BF16),
}


def _is_spec(x):
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)


def _uint_view(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def random_bits_tree(seed, spec=MIXED_SPEC):
    """Leaves with uniformly random bit patterns over the whole non-NaN range (huge and tiny
    values, subnormals, -0, +-inf planted). NaNs are replaced: XLA's CPU backend computes bf16
    through f32 and canonicalises NaN payloads, which no weight carries."""
    rng = np.random.default_rng(seed)

    def make(sd):
        shape, dtype = sd
        it = np.dtype(dtype).itemsize
        ut = {2: np.uint16, 4: np.uint32}[it]
        bits = rng.integers(0, 2 ** (8 * it), size=shape, dtype=ut).ravel()
        vals = bits.view(np.dtype(dtype))
        nan = np.isnan(vals.astype(np.float32))
        bits[nan] &= ut(2 ** (8 * it) - 1 - (1 << (8 * it - 2)))  # clear the top exponent bit: finite
        special = np.array([0.0, -0.0, np.inf, -np.inf, 1e-40], np.dtype(dtype)).view(ut)
        k = min(len(special), bits.size)
        bits[rng.choice(bits.size, size=k, replace=False)] = special[:k]
        return jnp.asarray(bits.reshape(shape).view(np.dtype(dtype)))

    return jax.tree.map(make, spec, is_leaf=_is_spec)


def random_normal_tree(seed, spec=MIXED_SPEC, scale=3.0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda sd: jnp.asarray((scale * rng.standard_normal(sd[0])).astype(np.dtype(sd[1]))),
                        spec, is_leaf=_is_spec)


def assert_bit_equal(a, b, what=""):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype, (what, a.dtype, b.dtype)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    np.testing.assert_array_equal(_uint_view(a), _uint_view(b), err_msg=what)


def assert_trees_bit_equal(x, y):
    fx, tx = jax.tree_util.tree_flatten_with_path(x)
    fy, ty = jax.tree_util.tree_flatten_with_path(y)
    assert tx == ty
    for (p, a), (_, b) in zip(fx, fy):
        assert_bit_equal(a, b, jax.tree_util.keystr(p))


def shuffled_order(tree, seed):
    paths = [jax.tree_util.keystr(p, simple=True, separator="/")
             for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return [paths[i] for i in np.random.default_rng(seed).permutation(len(paths))]


CHUNK_SIZES = [4099, 4224, 5000, 9000, None]  # None: searched


# ---- case 6: mixed dtypes, awkward sizes ------------------------------------------------------

@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("shuffle", [False, True])
def test_case6_pack_unpack_bit_exact(chunk_size, seed, shuffle):
    tree = random_bits_tree(seed)
    order = shuffled_order(tree, seed + 100) if shuffle else None
    lay = build_layout(tree, chunk_size, order)
    chunks = lay.pack(tree)
    assert len(chunks) == lay.n_chunks
    for c, buf in enumerate(chunks):
        assert buf.shape == (lay.chunk_size,)
        assert buf.dtype == lay.chunk_dtypes[c]
    assert_trees_bit_equal(lay.unpack(chunks), tree)
    # padding is zero: zero every leaf's slot and nothing non-zero must remain
    for c, buf in enumerate(chunks):
        u = _uint_view(buf).copy()
        for s in lay.chunk_leaves(c):
            u[s.offset:s.offset + s.size] = 0
        assert not u.any(), f"chunk {c} has non-zero padding"


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("shuffle_seed", [None, 3, 4])
def test_case6_slots_disjoint_in_bounds_one_dtype(chunk_size, shuffle_seed):
    tree = random_normal_tree(0)
    order = None if shuffle_seed is None else shuffled_order(tree, shuffle_seed)
    lay = build_layout(tree, chunk_size, order)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    assert len(lay.slots) == len(leaves)
    by_chunk = {}
    for s, (p, leaf) in zip(lay.slots, leaves):
        assert s.path == jax.tree_util.keystr(p, simple=True, separator="/")
        assert s.shape == leaf.shape and s.size == leaf.size
        assert 0 <= s.offset and s.offset + s.size <= lay.chunk_size, s
        assert np.dtype(s.dtype) == np.dtype(leaf.dtype)
        assert np.dtype(lay.chunk_dtypes[s.chunk]) == np.dtype(leaf.dtype), "chunk mixes dtypes"
        by_chunk.setdefault(s.chunk, []).append(s)
    assert sorted(by_chunk) == list(range(lay.n_chunks)), "an empty chunk or a gap in chunk ids"
    for c, ss in by_chunk.items():
        ss.sort(key=lambda s: s.offset)
        for s0, s1 in zip(ss, ss[1:]):
            assert s0.offset + s0.size <= s1.offset, f"{s0.path} overlaps {s1.path}"
    # first-use order: within a dtype group, (chunk, offset) increases along the order
    paths = order or [s.path for s in lay.slots]
    slot = {s.path: s for s in lay.slots}
    for dt in {np.dtype(s.dtype) for s in lay.slots}:
        pos = [(slot[p].chunk, slot[p].offset) for p in paths if np.dtype(slot[p].dtype) == dt]
        assert pos == sorted(pos)


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("seed", [0, 5])
def test_case6_waste_bytes_recount(chunk_size, seed):
    tree = random_normal_tree(seed)
    order = shuffled_order(tree, seed)
    lay = build_layout(tree, chunk_size, order)
    used = np.zeros(lay.n_chunks, np.int64)
    for s in lay.slots:
        used[s.chunk] += s.size
    itemsize = np.array([np.dtype(d).itemsize for d in lay.chunk_dtypes])
    assert lay.waste_bytes == int(np.sum((lay.chunk_size - used) * itemsize))
    # the same from the packed buffers' byte sizes
    leaf_bytes = sum(x.nbytes for x in jax.tree.leaves(tree))
    assert lay.waste_bytes == sum(b.nbytes for b in lay.pack(tree)) - leaf_bytes


def _candidate_grid(tree, min_chunks=1, n_candidates=64, max_factor=2.0):
    """The grid of search_chunk_size, re-derived from its documented rule."""
    sizes = [math.prod(x.shape) for x in jax.tree.leaves(tree)]
    ru = lambda x: -(-x // CHUNK_ALIGN_ELEMS) * CHUNK_ALIGN_ELEMS  # noqa: E731
    lo = ru(max(sizes))
    hi = max(lo, ru(int(lo * max_factor)))
    if min_chunks > 1:
        hi = max(lo, min(hi, ru(sum(sizes) // min_chunks)))
    step = max(CHUNK_ALIGN_ELEMS, ru((hi - lo) // max(n_candidates, 1)))
    return list(range(lo, hi + 1, step))


def _random_spec(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 12))
    return {f"l{i:02d}": ((int(rng.integers(1, 3000)),), BF16 if rng.random() < 0.5 else F32) for i in range(n)}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("min_chunks", [1, 3])
def test_case6_search_minimises_waste_bytes(seed, min_chunks):
    spec = MIXED_SPEC if seed == 0 else _random_spec(seed)
    tree = jax.tree.map(lambda sd: jax.ShapeDtypeStruct(*sd), spec, is_leaf=_is_spec)
    order = shuffled_order(tree, seed) if seed % 2 else None
    cs = search_chunk_size(tree, order, min_chunks=min_chunks)
    grid = _candidate_grid(tree, min_chunks)
    largest = max(math.prod(x.shape) for x in jax.tree.leaves(tree))
    assert cs >= largest and cs % CHUNK_ALIGN_ELEMS == 0 and cs in grid
    waste = {g: build_layout(tree, g, order).waste_bytes for g in grid}
    assert waste[cs] == min(waste.values())
    assert cs == min(g for g in grid if waste[g] == waste[cs]), "ties must go to the smaller size"
    # build_layout(chunk_size=None) uses the search
    assert build_layout(tree, None, order, min_chunks=min_chunks).chunk_size == cs


def test_case6_search_counts_bytes_not_elements():
    """Crafted: at 256 elements the waste is mostly cheap bf16 padding (416 elements, 1472 bytes);
    at 384 the f32 leaves pair up exactly (544 elements but only 1216 bytes). A search counting
    elements would pick 256; the byte count picks 384."""
    spec = {"l0": ((192,), F32), "l1": ((192,), F32), "l2": ((224,), BF16), "l3": ((224,), BF16),
            "l4": ((224,), BF16), "l5": ((160,), F32), "l6": ((160,), F32)}
    tree = jax.tree.map(lambda sd: jax.ShapeDtypeStruct(*sd), spec, is_leaf=_is_spec)
    grid = _candidate_grid(tree)
    assert grid == [256, 384, 512]

    def waste_elems(lay):
        return lay.n_chunks * lay.chunk_size - lay.n_elements

    lays = {g: build_layout(tree, g) for g in grid}
    assert [lays[g].waste_bytes for g in grid] == [1472, 1216, 1984]
    assert [waste_elems(lays[g]) for g in grid] == [416, 544, 672]
    by_elems = min(grid, key=lambda g: (waste_elems(lays[g]), g))
    assert by_elems == 256
    assert search_chunk_size(tree) == 384 != by_elems


@pytest.mark.parametrize("chunk_size", [4098, 1000, 1])
def test_chunk_size_smaller_than_largest_leaf_raises(chunk_size):
    spec = {"small": ((5,), F32), "enc": {"big": {"w": ((4099,), BF16)}}, "mid": ((300,), F32)}
    tree = jax.tree.map(lambda sd: jax.ShapeDtypeStruct(*sd), spec, is_leaf=_is_spec)
    with pytest.raises(ValueError) as ei:
        build_layout(tree, chunk_size)
    msg = str(ei.value)
    assert "enc/big/w" in msg and "4099" in msg and str(chunk_size) in msg
    build_layout(tree, 4099)  # exactly the largest leaf is fine


# ---- case 7: wrapping pre-loaded weights ---------------------------------------------------------

PRELOADED_SPEC = {
    "emb": ((37, 24), F32),
    "blk": {"w1": ((24, 61), F32), "b1": ((61,), F32), "w2": ((61, 24), F32), "ln": ((24,), F32)},
    "head": ((24, 5), F32),
    "lonely": ((1,), F32),
}


def _preloaded_tree(seed):
    """Weights as a checkpoint would hold them: random scales over six decades, a mix of numpy
    and jax arrays, nothing like init values (no zeros, no ones)."""
    rng = np.random.default_rng(seed)
    count = iter(range(1000))

    def make(sd):
        a = (rng.standard_normal(sd[0]) * 10.0 ** rng.uniform(-3, 3, size=sd[0])).astype(np.float32)
        return a if next(count) % 2 else jnp.asarray(a)

    return jax.tree.map(make, PRELOADED_SPEC, is_leaf=_is_spec)


def _one_stage(tree):
    keys = tuple(tree)
    return (Stage("all", keys, lambda p, x, b: sum(jnp.sum(v) for v in jax.tree.leaves(p)) * 0.0),)


def _placements(n):
    return {
        "all_device": Placement.uniform(n, DEVICE, DEVICE),
        "all_host": Placement.uniform(n, PINNED_HOST, PINNED_HOST),
        "mixed": Placement.from_device_chunks(n, range(0, n, 2)),
        "params_host_state_device": Placement.uniform(n, PINNED_HOST, DEVICE),
    }


@pytest.mark.parametrize("placement", ["all_device", "all_host", "mixed", "params_host_state_device"])
@pytest.mark.parametrize("compute_dtype", [F32, BF16])
def test_case7_preloaded_weights_survive_init(placement, compute_dtype):
    tree = _preloaded_tree(seed=7)
    lay = build_layout(tree, 1600)
    assert lay.n_chunks >= 3
    pl = _placements(lay.n_chunks)[placement]
    step = make_chunked_step(_one_stage(tree), lay, pl, optax.adamw(1e-3), compute_dtype)
    state = step.init(tree)
    for c in range(lay.n_chunks):
        assert state.params[c].sharding.memory_kind == pl.param_kinds[c]
        assert state.master[c].sharding.memory_kind == pl.state_kinds[c]
        assert state.params[c].dtype == compute_dtype and state.master[c].dtype == F32
    # master params: every pre-loaded leaf, bit-exact
    assert_trees_bit_equal(step.master_params(state), jax.tree.map(jnp.asarray, tree))
    # compute params: the leaves cast to the compute dtype, bit-exact
    dev = sharding(DEVICE)
    got = lay.unpack([jax.device_put(p, dev) for p in state.params])
    assert_trees_bit_equal(got, jax.tree.map(lambda a: jnp.asarray(a).astype(compute_dtype), tree))


# ---- first use order ------------------------------------------------------------------------------

@pytest.mark.parametrize("remat", [True, False])
def test_first_use_order_micro_gpt(remat):
    cfg = get_config("micro", remat=remat)
    from models.gpt import abstract_params
    params = dict(abstract_params(cfg))
    # never read; its key sorts first in tree order
    params["aaa_unused"] = {"w": jax.ShapeDtypeStruct((3, 3), F32)}
    batch = jax.ShapeDtypeStruct((2, 9), jnp.int32)
    order = first_use_order(lambda p, b: loss_fn(cfg, p, b), params, batch)
    n_leaves = len(jax.tree.leaves(params))
    assert len(order) == n_leaves == len(set(order))
    assert order[:2] == ["wte", "wpe"]
    assert order[-1] == "aaa_unused/w"
    assert order[-2] == "ln_f/scale"
    blocks = order[2:-2]
    assert len(blocks) == 6 * cfg.n_layers
    for i in range(cfg.n_layers):
        group = blocks[6 * i:6 * (i + 1)]
        assert all(p.startswith(f"h_{i}/") for p in group), group
    # the layout built from it opens chunk 0 with the embedding
    lay = build_layout(params, None, order)
    slot = {s.path: s for s in lay.slots}
    assert slot["wte"].chunk == 0 and slot["wte"].offset == 0
    assert slot["aaa_unused/w"].chunk == lay.n_chunks - 1


def test_first_use_order_follows_reads_not_tree_order():
    rng = np.random.default_rng(11)
    tree = {k: jnp.asarray(rng.standard_normal((4,)), F32) for k in "abcdef"}
    perm = list(rng.permutation(list("abcde")))  # "f" is never read

    def fn(p, x):
        for k in perm:
            x = x * p[k]
        return x.sum()

    order = first_use_order(fn, tree, jnp.ones((4,), F32))
    assert order == perm + ["f"]


# ---- pack / unpack under jit --------------------------------------------------------------------

@pytest.mark.parametrize("chunk_size", [4099, 9000])
def test_pack_unpack_under_jit(chunk_size):
    tree = random_bits_tree(21)
    lay = build_layout(tree, chunk_size, shuffled_order(tree, 21))
    eager = lay.pack(tree)
    jitted = jax.jit(lay.pack)(tree)
    assert len(eager) == len(jitted) == lay.n_chunks
    for a, b in zip(eager, jitted):
        assert_bit_equal(a, b)
    assert_trees_bit_equal(jax.jit(lay.unpack)(jitted), tree)
    assert_trees_bit_equal(jax.jit(lambda t: lay.unpack(lay.pack(t)))(tree), tree)
    # pack with an explicit dtype (master copies) under jit equals the eager cast
    f_eager = lay.pack(random_normal_tree(22), dtype=F32)
    f_jit = jax.jit(lambda t: lay.pack(t, dtype=F32))(random_normal_tree(22))
    for a, b in zip(f_eager, f_jit):
        assert a.dtype == F32
        assert_bit_equal(a, b)


def test_unpack_subtree_and_scatter_add_under_jit():
    rng = np.random.default_rng(31)
    tree = random_normal_tree(31)
    lay = build_layout(tree, 5000, shuffled_order(tree, 31))
    chunks = {c: b for c, b in enumerate(lay.pack(tree))}
    keys = ("g", "c", "f")
    sub = jax.jit(lambda ch: lay.unpack_subtree(ch, keys))({c: chunks[c] for c in lay.chunks_of(keys)})
    assert_trees_bit_equal(sub, {k: tree[k] for k in keys})
    # scatter_add of a gradient subtree into float32 accumulators == packing that subtree
    grads = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), F32), {k: tree[k] for k in keys})
    full = jax.tree.map(lambda a: jnp.zeros(a.shape, F32), tree)
    full.update(grads)
    want = lay.pack(full, dtype=F32)
    start = [jnp.asarray(rng.standard_normal(lay.chunk_size), F32) for _ in range(lay.n_chunks)]
    for c in range(lay.n_chunks):
        got = jax.jit(lambda acc, g, c=c: lay.scatter_add(acc, c, g))(start[c], grads)
        np.testing.assert_allclose(np.asarray(got), np.asarray(start[c] + want[c]), rtol=1e-6, atol=1e-6)
