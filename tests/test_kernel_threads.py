"""The host kernels' dynamic division of a chunk among numba threads (chunkjax.kernel_threads).

The division must not change a single bit: every element is updated exactly once by the same
per-element code. Checked against the kernels' own single-range loop run on one thread, and the
atomic claim against double or missed claims."""
import numba
import numpy as np
import pytest
from numba import prange

from chunkjax import kernels as K
from chunkjax.kernel_threads import BLOCK, bounds_threads, claim, guided_bounds


@pytest.mark.parametrize("threads", [1, 2, 3, 8, 16, 64])
def test_guided_bounds_cover_each_block_once_large_ranges_first(threads):
    rng = np.random.default_rng()
    for nb in [0, 1, 2, *rng.integers(3, 50_000, size=20)]:
        b = guided_bounds(int(nb), threads)
        assert b[0] == 0 and b[-1] == nb
        sizes = np.diff(b)
        assert (sizes >= 1).all()
        assert (np.diff(sizes) <= 0).all()  # never a larger range after a smaller one
        if nb >= 4 * threads:
            assert sizes[0] == nb // (2 * threads)
            assert sizes[-1] == 1
        assert len(sizes) <= nb


@numba.njit(parallel=True)
def _claim_all(marks, threads, ctr):
    for _ in prange(threads):
        k = claim(ctr)
        while k < marks.size:
            marks[k] += 1
            k = claim(ctr)


def test_claims_are_atomic_each_index_once():
    threads = numba.config.NUMBA_NUM_THREADS
    marks = np.zeros(200_003, np.int64)
    ctr = np.zeros(1, np.int64)
    _claim_all(marks, threads, ctr)
    assert (marks == 1).all()
    assert ctr[0] == marks.size + threads  # each loop made one claim past the end
    assert bounds_threads(guided_bounds(3, 16), 16) == 3 and bounds_threads(guided_bounds(0, 8), 8) == 1


def _problem(rng, n, fp32_grad):
    g = rng.standard_normal(n, dtype=np.float32) * rng.uniform(0.1, 10)
    g = g if fp32_grad else K.bf16_round_bits(g)
    return ([rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32),
             rng.random(n, dtype=np.float32)], g)


@pytest.mark.parametrize("fp32_grad", [False, True])
@pytest.mark.parametrize("spec", [K.AdamW(3e-3, weight_decay=0.1), K.Lion(1e-3), K.SGDMomentum(1e-2, nesterov=True,
                                                                                              weight_decay=1e-2)])
def test_kernels_bit_identical_to_one_thread_loop(spec, fp32_grad):
    rng = np.random.default_rng()
    top = numba.config.NUMBA_NUM_THREADS
    for threads in sorted({1, min(2, top), top}):
        n = int(rng.integers(3 * BLOCK, 40 * BLOCK)) + int(rng.integers(1, BLOCK))  # a short last block
        (master, a, b), g = _problem(rng, n, fp32_grad)
        hyper = K.step_hyper(spec, int(rng.integers(0, 100)), 1e-3)
        scale = K.clip_scale(1.0, float(rng.uniform(1.5, 9.0)))  # clipping fires: both factors used
        moments = (a, b) if isinstance(spec, K.AdamW) else (a,)
        ref = [x.copy() for x in (master, *moments)]
        ref_out = np.empty(n, np.uint16)
        hp = tuple(hyper)
        f = {K.AdamWStep: K._adamw_range, K.LionStep: K._lion_range}.get(type(hyper))
        if f is not None:
            f(0, n, *ref, g, ref_out, scale, hp)
        else:
            K._momentum_range(0, n, *ref, g, ref_out, scale, bool(hyper.nesterov), hp[:3])
        out = np.empty(n, np.uint16)
        saved = numba.get_num_threads()
        numba.set_num_threads(threads)
        try:
            K.update_(hyper, master, moments, g, out, scale)
        finally:
            numba.set_num_threads(saved)
        for got, want in zip((master, *moments, out), (*ref, ref_out)):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fp32_grad", [False, True])
@pytest.mark.parametrize("spec", [K.AdamW(3e-3, weight_decay=0.1), K.Lion(1e-3), K.SGDMomentum(1e-2, nesterov=True,
                                                                                              weight_decay=1e-2)])
def test_float32_params_out_is_the_new_master_in_one_pass(spec, fp32_grad):
    """A float32 compute copy written by the kernel itself (the host updater's float32 params, one
    pass instead of a copy after it): bit for bit the new master params, and the master and
    moments bit for bit those of the same update without an output; on one block and on many."""
    rng = np.random.default_rng()
    for n in (int(rng.integers(2, BLOCK)), int(rng.integers(3 * BLOCK, 10 * BLOCK)) + 7):
        (master, a, b), g = _problem(rng, n, fp32_grad)
        hyper = K.step_hyper(spec, int(rng.integers(0, 100)), 1e-3)
        scale = K.clip_scale(1.0, float(rng.uniform(1.5, 9.0)))
        moments = (a, b) if isinstance(spec, K.AdamW) else (a,)
        ref = [x.copy() for x in (master, *moments)]
        before = master.copy()
        K.update_(hyper, ref[0], tuple(ref[1:]), g, None, scale)
        out = np.full(n, np.nan, np.float32)
        K.update_(hyper, master, moments, g, out, scale)
        for got, want in zip((master, *moments), ref):
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        np.testing.assert_array_equal(out.view(np.uint32), master.view(np.uint32))
        assert not np.array_equal(master, before)  # the step moved the params
