"""The memory tide and Belady eviction (issue 3 groundwork): eviction against brute force on
small synthetic access traces; the tide's shape on the micro GPT."""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkjax as cj
from chunkjax.eviction import CapacityError, belady
from chunkjax.tide import BACKWARD, FORWARD, FUSED, memory_tide
from models import gpt


def brute_force_min_fetches(accesses, caps, n_chunks):
    """Exact minimum number of fetches by dynamic programming over resident sets."""
    T = len(accesses)

    @functools.lru_cache(maxsize=None)
    def best(t, resident):
        if t == T:
            return 0
        need = frozenset(accesses[t])
        cost = len(need - resident)
        keep_pool = sorted(resident - need)
        out = None
        room = caps[t] - len(need)
        for k in range(0, min(room, len(keep_pool)) + 1):
            for keep in itertools.combinations(keep_pool, k):
                v = best(t + 1, need | frozenset(keep))
                out = v if out is None else min(out, v)
        return cost + out

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(40))
def test_belady_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n_chunks = int(rng.integers(3, 7))
    T = int(rng.integers(4, 12))
    accesses = [tuple(sorted(rng.choice(n_chunks, size=int(rng.integers(1, 3)), replace=False).tolist()))
                for _ in range(T)]
    varying = seed % 2 == 1
    caps = [int(rng.integers(len(a), len(a) + 3)) if varying else 3 for a in accesses]
    caps = [max(c, len(a)) for c, a in zip(caps, accesses)]
    plan = belady(accesses, caps)
    assert plan.n_fetches == brute_force_min_fetches(accesses, caps, n_chunks)
    # the plan is consistent: every read chunk is resident, capacity never exceeded
    for t, a in enumerate(accesses):
        assert set(a) <= plan.resident_after[t]
        assert len(plan.resident_after[t]) <= caps[t]


def test_belady_capacity_error():
    with pytest.raises(CapacityError, match="reads 3 chunks at once but only 2"):
        belady([(0, 1, 2)], 2)


def test_belady_evicts_furthest_next_use():
    # capacity 2: at t=2 chunk 2 is needed; 0 is used again at t=3, 1 never: evict 1
    plan = belady([(0,), (1,), (2,), (0,)], 2)
    assert plan.evict[2] == (1,)
    assert plan.fetch[3] == ()


@pytest.fixture(scope="module")
def micro_traces():
    cfg = gpt.get_config("micro", n_layers=2)
    stages = gpt.gpt_stages(cfg)
    ap = gpt.abstract_params(cfg)
    ab = jax.ShapeDtypeStruct((2, 33), jnp.int32)
    layout = cj.build_layout(ap, cfg.vocab_size * cfg.d_model,
                             cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), ap, ab))
    return layout, cj.trace_stages(stages, layout, ab, jnp.float32)


def test_tide_rises_then_falls(micro_traces):
    layout, traces = micro_traces
    tide = memory_tide(traces, layout.chunk_size)
    n = len(traces)
    assert len(tide.moments) == 2 * n - 1
    assert [m.phase for m in tide.moments] == [FORWARD] * (n - 1) + [FUSED] + [BACKWARD] * (n - 1)
    # saved activations accumulate through the forward pass and are released in backward
    saved_fwd = np.cumsum([t.input_bytes for t in traces[: n - 1]])
    for m, s in zip(tide.moments[: n - 1], saved_fwd):
        assert m.non_model_bytes == s + traces[m.stage].temp_bytes
    # the tied embedding chunk is read first and last; the embed backward reads no values
    wte_chunk = layout.chunks_of(["wte"])[0]
    assert wte_chunk in tide.moments[0].chunks and wte_chunk in tide.moments[n - 1].chunks
    assert tide.moments[-1].name == "embed" and tide.moments[-1].chunks == ()
    assert tide.peak_non_model_bytes == max(tide.to_dict()["non_model_bytes"])
