"""Rollback by inversion (chunkjax.kernels_inverse, chunkjax.speculate): speculated host updates
undone from their gradient, no backup copy.

Two levels, CPU, float32, fresh random inputs:
* the kernels: one forward step then its inverse gives back the master params and moments to a
  few float32 ulps of the larger of the old value, the new value and the gradient's term (the
  error a rounding of the new value allows);
* :class:`chunkjax.speculate.Speculation` driven over 20 steps of synthetic chunks (every
  chunk's update speculated before the global norm is known, as on the GPU) against plain optax
  (``spec.optax()`` on the list of chunks, eager on the CPU): clipping that never fires, fires on
  every step (far below the norm), fires on some steps; a non-finite step with skip; loss
  scaling; in both states of the policy (speculating, and waiting after a step where clipping
  fired) and with the policy off (``"always"``), for AdamW, Lion and SGD with momentum.
"""
import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from chunkjax import speculate
from chunkjax.host_update import AdamW, Lion, SGDMomentum, host_invert_, host_invertible, host_update_
from chunkjax.kernels import bf16_round_bits, step_hyper
from chunkjax.kernels_inverse import gradient_finite, invert_, invertible
from chunkjax.topology import SingleDevice
from chunkjax.updaters import host_inverter, host_updater, host_write_params

SIZES = (5000, 4096 + 3, 700, 9000)  # chunks over and under one kernel block (threaded and not)
STEPS = 20


def _names(st):
    return [f for f in ("m", "v", "trace") if hasattr(st, f)]


def _ulps_of_scale(after, before, new, grad_term):
    """max |after - before| in float32 ulps of max(|before|, |new|, |grad_term|)."""
    scale = np.maximum(np.maximum(np.abs(before), np.abs(new)), np.abs(grad_term)).astype(np.float32)
    return float(np.max(np.abs(after.astype(np.float64) - before) / np.spacing(scale)))


def _step_term(spec, new, g, count):
    """lr times the magnitude of the update's terms (float64), what the params' inverse subtracts."""
    lr = float(spec.learning_rate)
    if isinstance(spec, AdamW):
        t = count + 1
        m, v = new[1] / (1 - spec.b1**t), new[2] / (1 - spec.b2**t)
        return lr * np.abs(m) / (np.sqrt(v) + spec.eps)
    if isinstance(spec, Lion):
        return np.full(g.shape, lr)
    return lr * (np.abs(g) + np.abs(new[1]))


@pytest.mark.parametrize("spec", [AdamW(1e-3, weight_decay=0.1), AdamW(3e-2, b1=0.5, b2=0.9, eps=1e-6),
                                  Lion(1e-4, weight_decay=0.1), SGDMomentum(1e-2, 0.9, weight_decay=1e-3),
                                  SGDMomentum(1e-2, 0.9, nesterov=True, weight_decay=1e-3)],
                         ids=["adamw", "adamw_b", "lion", "sgd", "sgd_nesterov"])
@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
def test_forward_then_inverse_returns_the_state(spec, bf16):
    """A step after 5 steps of history, then its inverse: master params and moments within
    2 ulps of max(|old|, |new|, |the step's term|) (the gradient's term of a moment, lr times the
    update's terms for the params; measured: at most 2.0 for both, every spec and dtype), the
    count back; padding (zero gradient, params and moments) stays exactly 0."""
    rng = np.random.default_rng(11)
    n = 3 * 4096 + 17
    st, master = spec.host_state(n), rng.standard_normal(n).astype(np.float32)
    for _ in range(5):
        host_update_(spec, st, rng.standard_normal(n).astype(np.float32), master)
    g = rng.standard_normal(n).astype(np.float32) * np.float32(3)
    master[-17:], g[-17:] = 0, 0
    for f in _names(st):
        getattr(st, f)[-17:] = 0
    g_in = bf16_round_bits(g) if bf16 else g
    g = g_in.astype(np.uint32).__lshift__(16).view(np.float32) if bf16 else g
    old = [master.copy()] + [getattr(st, f).copy() for f in _names(st)]
    count = st.count
    assert host_invertible(spec, st)
    host_update_(spec, st, g_in, master, None, (np.float32(0.5), np.float32(1.5)))
    new = [master.copy()] + [getattr(st, f).copy() for f in _names(st)]
    host_invert_(spec, st, g_in, master, (np.float32(0.5), np.float32(1.5)))
    assert st.count == count
    g = g * np.float32(0.75)
    terms = {"m": g * (1 - getattr(spec, "b1" if isinstance(spec, AdamW) else "b2", 0.9)),
             "v": g * g * (1 - getattr(spec, "b2", 0.0)), "trace": g, "p": _step_term(spec, new, g, count)}
    after = [master] + [getattr(st, f) for f in _names(st)]
    for name, a, b, nw in zip(["p"] + _names(st), after, old, new):
        err = _ulps_of_scale(a, b, nw, terms[name])
        assert err <= 2.0, (name, err)
        np.testing.assert_array_equal(a[-17:], 0)


def test_invertibility_and_finiteness_checks():
    """Zero decay rates and lr * wd > 1/2 are refused (named in one line); a non-finite scaled
    gradient, or one whose square overflows, is found by gradient_finite in the threaded and the
    one-block kernel; bf16 bits are read as bf16."""
    assert not invertible(step_hyper(AdamW(1e-3, b1=0.0), 0, 1e-3))
    assert not invertible(step_hyper(AdamW(1e-3, b2=0.0), 0, 1e-3))
    assert not invertible(step_hyper(Lion(1e-3, b2=0.0), 0, 1e-3))
    assert not invertible(step_hyper(SGDMomentum(1e-2, momentum=0.0), 0, 1e-2))
    assert not invertible(step_hyper(AdamW(0.9, weight_decay=0.9), 0, 0.9))
    assert invertible(step_hyper(Lion(1e-3, b1=0.0), 0, 1e-3))  # b1 only shapes the sign
    st = AdamW(1e-3, b1=0.0).host_state(3)
    assert not host_invertible(AdamW(1e-3, b1=0.0), st)
    with pytest.raises(ValueError, match="not invertible"):
        invert_(step_hyper(AdamW(1e-3, b1=0.0), 0, 1e-3), np.zeros(3, np.float32),
                (np.zeros(3, np.float32), np.zeros(3, np.float32)), np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="no step to undo"):
        host_invert_(AdamW(1e-3), AdamW(1e-3).host_state(3), np.zeros(3, np.float32), np.zeros(3, np.float32))
    for n in (100, 3 * 4096 + 5):
        g = np.random.default_rng(n).standard_normal(n).astype(np.float32)
        assert gradient_finite(g) and gradient_finite(bf16_round_bits(g), 1e3)
        for bad in (np.nan, np.inf, 3e19):  # 3e19 squares past float32's range
            b = g.copy()
            b[n // 2] = bad
            assert not gradient_finite(b) and not gradient_finite(bf16_round_bits(b))
        assert not gradient_finite(g, (np.float32(1e20), np.float32(1)))


# ---- the speculation over 20 steps, against optax ------------------------------------------------

class _State:
    """A host-chunk state as the step's: lists of master params, host states, compute params (float32
    CPU jax arrays, updated in place through writable views as the step's pinned buffers)."""

    def __init__(self, spec, params):
        self.master = [p.copy() for p in params]
        self.opt_state = [spec.host_state(p.size) for p in params]
        with jax.default_device(jax.devices("cpu")[0]):
            self.params = [jnp.array(p) for p in params]


def _speculation(spec, *, skip, inv, pool, rollback, policy, previous):
    """The step's own host updater, parameter writer and inverter (one device, float32 compute)."""
    topo = SingleDevice()
    update = host_updater(topo, spec, 1, jnp.float32).update
    inverter = host_inverter(topo, spec, jnp.float32) if rollback == "invert" else None
    return speculate.Speculation(update, host_write_params(topo, jnp.float32), spec, skip=skip, inv=inv, pool=pool,
                                 inverter=inverter, policy=policy, previous=previous)


def _run(spec, grads, *, skip=False, loss_scale=1.0, rollback="invert", policy="always", pool_bytes=1 << 30):
    """Train the chunks through :class:`Speculation` as the step does: the host thread updates
    every chunk before the norm is set (speculating, or waiting and stalled), then validates.
    Returns (state, per step (speculating, speculated, inverted, redone, fired))."""
    rng = np.random.default_rng(5)
    st = _State(spec, [rng.standard_normal(n).astype(np.float32) for n in SIZES])
    pool, prev, log = speculate.BackupPool(pool_bytes), None, []
    with concurrent.futures.ThreadPoolExecutor(1) as host:
        for gs in grads:
            scaled = [(g * np.float32(loss_scale)).astype(np.float32) for g in gs]
            sp = _speculation(spec, skip=skip, inv=1.0 / loss_scale, pool=pool, rollback=rollback, policy=policy,
                              previous=prev)
            fut = host.submit(sp.update, st, dict(enumerate(scaled)))
            concurrent.futures.wait([fut, sp.stalled], return_when=concurrent.futures.FIRST_COMPLETED)
            with np.errstate(all="ignore"):
                sp.set_norm(np.float32(np.sqrt(sum(np.sum(g.astype(np.float32) ** 2, dtype=np.float32)
                                                   for g in scaled))))
            fut.result()
            sp.validate(st)
            log.append((sp.speculating, sp.speculated, sp.inverted, sp.redone, sp.fired))
            prev = sp
    return st, log


def _optax(spec, grads, skip_steps=()):
    """Plain optax (eager, CPU, float32) on the list of chunks; a step in ``skip_steps`` is skipped."""
    rng = np.random.default_rng(5)
    with jax.default_device(jax.devices("cpu")[0]):
        params = [jnp.asarray(rng.standard_normal(n).astype(np.float32)) for n in SIZES]
        tx = spec.optax()
        state = tx.init(params)
        for k, gs in enumerate(grads):
            if k in skip_steps:
                continue
            upd, state = tx.update([jnp.asarray(g) for g in gs], state, params)
            params = optax.apply_updates(params, upd)
    return [np.asarray(p) for p in params], state


def _grads(scales, seed=9):
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal(n) * s).astype(np.float32) for n in SIZES] for s in scales]


# one gradient scale per step: steps 3, 4, 9, 15 large (clipping fires on them at CLIP_SOME)
SCALES = [1.0, 1.2, 0.8, 6.0, 5.0, 1.0, 0.9, 1.1, 1.0, 7.0, 1.0, 0.7, 1.3, 1.0, 0.9, 6.5, 1.0, 1.0, 1.2, 0.8]
NORM = float(np.sqrt(sum(SIZES)))  # the global norm at scale 1
CLIP_SOME = 3.0 * NORM
FIRES_SOME = [s * NORM >= CLIP_SOME for s in SCALES]


def _assert_equal(st, ref, spec):
    ref_p, ref_state = ref
    for a, b in zip(st.master, ref_p):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    counts = {int(s.count) for s in st.opt_state}
    assert len(counts) == 1
    leaves = {type(x).__name__: x for x in jax.tree.leaves(ref_state, is_leaf=lambda x: hasattr(x, "_fields"))}
    adam = leaves.get("ScaleByAdamState")
    if adam is not None:
        for c, s in enumerate(st.opt_state):
            np.testing.assert_allclose(s.m, np.asarray(adam.mu[c]), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(s.v, np.asarray(adam.nu[c]), rtol=1e-5, atol=2e-8)
        assert counts == {int(adam.count)}


def _expected_policy(log, fired, policy):
    """Speculating after each step that did not fire, not on the first ("after_common"), or
    always; every chunk speculated when speculating; redone exactly on fired speculating steps."""
    n = len(SIZES)
    for k, (speculating, s, i, r, f) in enumerate(log):
        want = policy == "always" or (k > 0 and not fired[k - 1])
        assert (speculating, s, i) == (want, n * want, n * want), (k, log[k])
        assert (r, f) == (n * (want and fired[k]), fired[k]), (k, log[k])


# step 12 a spike: 30x the gradient, clipped to a factor of ~0.1 after a step that did not clip (100x, 1000x:
# toward the ill-conditioned regime of docs/design.md, early in training where v is still small)
SCALES_SPIKE = SCALES[:12] + [30.0] + SCALES[13:]


@pytest.mark.parametrize("policy", ["after_common", "always"])
@pytest.mark.parametrize("case", ["never", "every", "some", "spike"])
def test_adamw_clipping_equals_optax(case, policy):
    """(a) never fires, (b) fires on every step (threshold far below the norm), (c) fires on some
    steps, (c') a spike far above the threshold on a step after one that did not clip: equal to
    optax (params rtol 1e-5 atol 1e-6, moments rtol 1e-5), chunks speculated and redone as the
    policy says. (b) with the policy off, inverting on every step, is the ill-conditioned regime
    (docs/design.md, "Rollback by inversion"): it runs with ``rollback="backup"`` here."""
    clip = {"never": 1e3 * NORM, "every": 1e-3 * NORM, "some": CLIP_SOME, "spike": CLIP_SOME}[case]
    spec = AdamW(1e-3, weight_decay=0.1, max_grad_norm=clip)
    scales = SCALES_SPIKE if case == "spike" else SCALES
    grads = _grads(scales)
    fired = [s * NORM >= clip for s in scales]
    rollback = "backup" if (case, policy) == ("every", "always") else "invert"
    st, log = _run(spec, grads, rollback=rollback, policy=policy)
    _assert_equal(st, _optax(spec, grads), spec)
    if rollback == "invert":
        _expected_policy(log, fired, policy)
        assert case != "spike" or log[12][3] == len(SIZES)  # the spike's step inverted and redone
    else:
        assert all(s == r == len(SIZES) and i == 0 for _, s, i, r, _ in log)


@pytest.mark.parametrize("spec", [Lion(1e-4, weight_decay=0.1, max_grad_norm=CLIP_SOME),
                                  SGDMomentum(1e-2, 0.9, nesterov=True, weight_decay=1e-3, max_grad_norm=CLIP_SOME),
                                  SGDMomentum(1e-2, 0.9, max_grad_norm=1e-3 * NORM)], ids=["lion", "sgd_nesterov",
                                                                                             "sgd_every"])
def test_lion_and_sgd_clipping_equal_optax(spec):
    """Lion and SGD with momentum, the policy off (every firing step inverted and redone)."""
    grads = _grads(SCALES)
    st, log = _run(spec, grads)
    _assert_equal(st, _optax(spec, grads), spec)
    fired = [s * NORM >= spec.max_grad_norm for s in SCALES]
    _expected_policy(log, fired, "always")


@pytest.mark.parametrize("loss_scale", [1.0, 2.0**12])
def test_nonfinite_step_skipped_and_loss_scaling_equal_optax(loss_scale):
    """(d) step 6 has a NaN in chunk 2 and an inf in chunk 3 (skip): chunks 0 and 1 are
    speculated and inverted back, chunk 2 waits for the norm (then known: chunk 3 too); the
    step changes nothing (optax without that step).
    (e) the same with loss scaling (gradients times 2^12, the factor's inverse folded in).
    Clipping fires on some steps too; the skipped step does not count as fired."""
    spec = AdamW(1e-3, weight_decay=0.1, max_grad_norm=CLIP_SOME)
    grads = _grads(SCALES)
    grads[6][2][17], grads[6][3][5] = np.nan, np.inf
    st, log = _run(spec, grads, skip=True, loss_scale=loss_scale, policy="after_common")
    _assert_equal(st, _optax(spec, grads, skip_steps={6}), spec)
    assert log[6] == (True, 2, 2, 2, False)
    fired = [f and k != 6 for k, f in enumerate(FIRES_SOME)]
    for k, (speculating, s, i, r, f) in enumerate(log):
        assert speculating == (k > 0 and not fired[k - 1]) and f == fired[k], (k, log[k])
        if k != 6:
            assert s == i == len(SIZES) * speculating and r == s * fired[k], (k, log[k])
    for c, p in enumerate(st.params):  # compute params: the master params (rewritten after the skip)
        np.testing.assert_array_equal(np.asarray(p), st.master[c])


def test_kept_gradients_bounded_and_not_invertible_backed_up():
    """The pool's bound limits the gradients kept for inversion (room for two chunks: two
    speculated, the rest wait); a step that cannot be inverted (b1 = 0) is backed up instead,
    bit-exact; both equal optax."""
    spec = AdamW(1e-3, weight_decay=0.1, max_grad_norm=CLIP_SOME)
    grads = _grads(SCALES[:8])
    bound = 4 * (SIZES[0] + SIZES[1])
    st, log = _run(spec, grads, pool_bytes=bound)
    _assert_equal(st, _optax(spec, grads), spec)
    assert all(s == i == 2 for _, s, i, _, _ in log)
    spec0 = AdamW(1e-3, b1=0.0, max_grad_norm=CLIP_SOME)
    st, log = _run(spec0, grads)
    _assert_equal(st, _optax(spec0, grads), spec0)
    assert all(s == len(SIZES) and i == 0 for _, s, i, _, _ in log) and any(r for _, _, _, r, _ in log)


def test_options_are_checked():
    with pytest.raises(ValueError, match="rollback='copy'"):
        speculate.check_options("copy", "always")
    with pytest.raises(ValueError, match="speculation_policy='never'"):
        speculate.check_options("invert", "never")


@pytest.mark.parametrize("spec, skip, loss_scale", [
    (AdamW(1e-3, weight_decay=0.1, max_grad_norm=CLIP_SOME), True, 2.0**12),
    (AdamW(1e-3, weight_decay=0.1, max_grad_norm=1e-3 * NORM), False, 1.0),
    (Lion(1e-4, weight_decay=0.1, max_grad_norm=CLIP_SOME), True, 1.0),
    (SGDMomentum(1e-2, 0.9, nesterov=True, weight_decay=1e-3, max_grad_norm=CLIP_SOME), True, 1.0)],
    ids=["adamw_skip_scaled", "adamw_every", "lion_skip", "sgd_skip"])
def test_bits_do_not_depend_on_which_chunks_speculated(spec, skip, loss_scale):
    """On a speculating step, a chunk that waits for the norm (its update started after the norm
    was known, or the bound was full) on a step whose factor is not the guess gets the bits of
    speculating on it (host_canonical_): every chunk speculated, a bound with room for two chunks
    and no room at all give bit-identical master params, moments and compute params, clipping
    firing on some (or every) step and, with skip, a non-finite step 6; equal to optax (with the
    policy on too) outside the ill-conditioned regime."""
    grads = _grads(SCALES)
    if skip:
        grads[6][2][17], grads[6][3][5] = np.nan, np.inf
    runs = {}
    for name, kw in {"always": dict(policy="always"),
                     "two_chunks": dict(policy="always", pool_bytes=4 * (SIZES[0] + SIZES[1])),
                     "none": dict(policy="always", pool_bytes=0)}.items():
        st, log = _run(spec, grads, skip=skip, loss_scale=loss_scale, **kw)
        runs[name] = st, log
    assert sum(e[1] for e in runs["none"][1]) == 0 < sum(e[3] for e in runs["always"][1])
    ref, _ = runs["always"]
    for name, (st, _) in runs.items():
        for c in range(len(SIZES)):
            for a, b in [(st.master[c], ref.master[c]), (np.asarray(st.params[c]), np.asarray(ref.params[c]))] + [
                    (getattr(st.opt_state[c], f), getattr(ref.opt_state[c], f)) for f in _names(st.opt_state[c])]:
                np.testing.assert_array_equal(a, b, err_msg=f"{name}, chunk {c}")
            assert st.opt_state[c].count == ref.opt_state[c].count
    if spec.max_grad_norm == CLIP_SOME:  # the policy off under steady clipping far below the norm: the ill-conditioned regime
        _assert_equal(ref, _optax(spec, grads, skip_steps={6} if skip else set()), spec)
    st, log = _run(spec, grads, skip=skip, loss_scale=loss_scale, policy="after_common")  # the policy on
    _assert_equal(st, _optax(spec, grads, skip_steps={6} if skip else set()), spec)


def test_canonical_kernel_is_forward_inverse_forward():
    """canonical_ in one pass gives the bits of update_ (guess), invert_, update_ (right), and of
    update_ then invert_ for a skip, for every spec, bf16 and float32 gradients, one block and
    several (with the compute params' bf16 bits)."""
    from chunkjax.kernels import update_
    from chunkjax.kernels_inverse import canonical_
    rng = np.random.default_rng(3)
    guess, right = (np.float32(1), np.float32(1)), (np.float32(0.3), np.float32(1.7))
    for spec in (AdamW(1e-3, weight_decay=0.1), Lion(1e-4, weight_decay=0.1),
                 SGDMomentum(1e-2, 0.9, nesterov=True, weight_decay=1e-3), SGDMomentum(1e-2, 0.5)):
        for n, bf16 in ((1000, False), (3 * 4096 + 17, True), (3 * 4096 + 17, False)):
            st, master = spec.host_state(n), rng.standard_normal(n).astype(np.float32)
            for _ in range(3):
                host_update_(spec, st, rng.standard_normal(n).astype(np.float32), master)
            g = (rng.standard_normal(n) * 3).astype(np.float32)
            g = bf16_round_bits(g) if bf16 else g
            hyper = step_hyper(spec, st.count, float(spec.learning_rate))
            for final in (right, None):
                a = [master.copy()] + [getattr(st, f).copy() for f in _names(st)]
                b = [x.copy() for x in a]
                out_a, out_b = np.zeros(n, np.uint16), np.zeros(n, np.uint16)
                update_(hyper, a[0], tuple(a[1:]), g, None, guess)
                invert_(hyper, a[0], tuple(a[1:]), g, guess)
                if final is not None:
                    update_(hyper, a[0], tuple(a[1:]), g, out_a, final)
                canonical_(hyper, b[0], tuple(b[1:]), g, out_b if final is not None else None, guess, final)
                for x, y in zip(a + [out_a], b + [out_b]):
                    np.testing.assert_array_equal(x, y)
