"""A loss over scored tokens only (prompt/completion data) normalised by the global count of
scored tokens (:mod:`chunkjax.loss_weight`), across micro-batches and ZeRO ranks.

The micro GPT (2 blocks) with a head that scores only unmasked targets and returns
:class:`chunkjax.WeightedLoss` ``(sum, count)``. Every row of the batch scores a different number
of targets, some none, so that micro-batches and ranks score different counts (one micro-batch
and some ranks none at all). Chunked runs with 4 micro-batches (host and device chunks), ZeRO
stage 2 over 2 ranks and ZeRO stage 3 over 4 ranks with 2 micro-batches must equal plain optax on
the whole batch with the token-weighted mean, ``grad(sum of losses / count)``, over 3 steps (fp32;
tolerances as tests/test_zero.py). A batch that scores no token is refused in one line before
any state changes. The job's side (prompt/completion data with ``--micro-batches 2``):
tests/test_hf.py::test_masked_held_out_loss_is_the_mean_over_scored_tokens.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import chunkjax as cj
from chunkjax import topology
from chunkjax.host_update import AdamW
from chunkjax.loss_weight import NO_SCORED_TOKENS, token_mean
from chunkjax.optim import state_bytes_per_chunk
from chunkjax.plan import plan_schedule
from models import gpt

B, T = 8, 16
#: Scored targets per row, one list per step: micro-batches of 2 rows score 19/0/9/17, 2/0/23/12,
#: 5/0/30/8; ranks of 4 rows 19/26, 2/35, 5/38; ranks of 1 row under 2 micro-batches some 0.
SCORED = ([16, 3, 0, 0, 9, 0, 12, 5], [2, 0, 0, 0, 16, 7, 1, 11], [0, 5, 0, 0, 14, 16, 0, 8])
SPEC = AdamW(3e-3, weight_decay=0.1, max_grad_norm=1.0)
#: Relative norm error allowed on each final param leaf (tests/test_zero.py's measure and bound:
#: the reference sums every token's gradient at once, the step per part and rank, and Adam's
#: division by sqrt(v) grows the float32 summation-order differences of small entries).
PARAM_RTOL = 3e-4


def _decode(b):
    return jnp.where(b < 0, -1 - b, b)


def _head(p, x, b):
    """Cross entropy summed over the scored targets (ids >= 0; ``-1 - t``: a prompt token) and their count."""
    targets = b[:, 1:]
    ce = optax.softmax_cross_entropy_with_integer_labels(gpt.head_logits(p, x), _decode(targets))
    keep = targets >= 0
    return cj.WeightedLoss(jnp.sum(jnp.where(keep, ce, 0.0)), jnp.sum(keep))


def _stages(cfg):
    base = gpt.gpt_stages(cfg)
    return ((cj.Stage("embed", ("wte", "wpe"), lambda p, x, b: gpt.embed_apply(p, x, _decode(b[:, :-1]))),)
            + base[1:-1] + (cj.Stage("head", ("ln_f", "wte"), _head),))


def _batch(rng, vocab, scored):
    b = rng.integers(0, vocab, (B, T + 1))
    for r, k in enumerate(scored):
        masked = 1 + rng.permutation(T)[k:]  # target columns not scored
        b[r, masked] = -1 - b[r, masked]
    return jnp.asarray(b, jnp.int32)


def _random_params(cfg, rng):
    """``gpt.init_params``' shapes and scale drawn with numpy (as tests/test_zero.py)."""
    def draw(path, a):
        if jax.tree_util.keystr(path).endswith("['scale']"):
            return jnp.ones(a.shape, jnp.float32)
        return jnp.asarray(rng.normal(0.0, 0.02, a.shape), jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, gpt.abstract_params(cfg))


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(11)
    cfg = gpt.get_config("micro", n_layers=2)
    params = _random_params(cfg, rng)
    batches = [_batch(rng, cfg.vocab_size, s) for s in SCORED]
    stages = _stages(cfg)
    tx = SPEC.optax()

    @jax.jit
    def ref_step(p, o, b):  # plain optax on the whole batch: the token-weighted mean
        loss, g = jax.value_and_grad(lambda p: token_mean(cj.compose_loss(stages, p, b)))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    p, o, losses = params, tx.init(params), []
    for b in batches:
        p, o, loss = ref_step(p, o, b)
        losses.append(float(loss))
    order = cj.first_use_order(lambda p, b: token_mean(cj.compose_loss(stages, p, b)), params, batches[0])
    return dict(cfg=cfg, params=params, batches=batches, stages=stages, order=order, ref=(p, np.asarray(losses)))


def _train(step, setup):
    state, losses = step.init(setup["params"]), []
    for b in setup["batches"]:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    step.wait(state)
    return state, np.asarray(losses)


def _assert_equal_to_optax(step, state, losses, setup):
    """Losses to 1e-5; each final param leaf to a relative norm error of ``PARAM_RTOL``."""
    ref_p, ref_losses = setup["ref"]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(step.master_params(state)), jax.tree.leaves(ref_p),
                            strict=True):
        a, b = np.asarray(a), np.asarray(b)
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert rel < PARAM_RTOL, (jax.tree_util.keystr(path), rel)


def _assert_refused_unchanged(step, state, setup):
    """A batch scoring no token: one line, no state changed, the next step runs."""
    before = [np.asarray(a) for a in jax.tree.leaves(step.master_params(state))]
    none = -1 - jnp.abs(setup["batches"][0])
    with pytest.raises(ValueError) as e:
        step(state, none)
    assert str(e.value) == NO_SCORED_TOKENS and "\n" not in str(e.value)
    for a, b in zip(jax.tree.leaves(step.master_params(state)), before, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    state, m = step(state, setup["batches"][0])
    assert np.isfinite(float(m["loss"]))


@pytest.fixture(scope="module")
def micro_batched(setup):
    """One device, 4 micro-batches of 2 rows: chunk 0 device-updated, the rest host-updated (their
    sums on the host-sums thread), three programs."""
    cfg, stages, params = setup["cfg"], setup["stages"], setup["params"]
    layout = cj.build_layout(params, None, setup["order"], min_chunks=6)
    traces = cj.trace_stages(stages, layout, jax.ShapeDtypeStruct((B // 4, T + 1), jnp.int32), jnp.float32)
    cb = cj.chunk_bytes(layout, jnp.float32, state_bytes_per_chunk(SPEC.optax(), layout.chunk_size))
    flops = cfg.flops_per_token(T) * B * T
    roomy = plan_schedule(layout, traces, cb, 10**12, flops_per_step=flops, resident=[0])
    sched = plan_schedule(layout, traces, cb, roomy.predicted.peak_device_bytes, flops_per_step=flops,
                          resident=[0], segments=(0, len(stages) + 1, len(roomy.moments) - 1))
    assert set(sched.update_locations) == {"device", "host"}
    step = cj.make_chunked_step(stages, layout, sched, host_optimizer=SPEC, compute_dtype=jnp.float32,
                                micro_batches=4)
    return step, _train(step, setup)


def test_four_micro_batches_equal_optax_on_the_token_mean(setup, micro_batched):
    step, (state, losses) = micro_batched
    _assert_equal_to_optax(step, state, losses, setup)
    assert step.host_chunks and step.device_chunks


def test_batch_without_scored_tokens_refused_micro_batches(setup, micro_batched):
    step, (state, _) = micro_batched
    _assert_refused_unchanged(step, state, setup)


@pytest.fixture(scope="module", params=[(2, 2, 1), (4, 3, 2)], ids=["zero2-2ranks", "zero3-4ranks-2mb"])
def zero(setup, request):
    n, stage, mb = request.param
    assert len(jax.devices()) >= n, "needs XLA_FLAGS=--xla_force_host_platform_device_count=8"
    layout = topology.build_zero_layout(setup["params"], n, setup["cfg"].vocab_size * setup["cfg"].d_model,
                                        setup["order"])
    placement = cj.Placement(tuple(cj.DEVICE if c % 2 else cj.PINNED_HOST for c in range(layout.n_chunks)),
                             tuple(cj.DEVICE if c % 3 == 0 else cj.PINNED_HOST for c in range(layout.n_chunks)))
    step = cj.make_chunked_step(setup["stages"], layout, placement, SPEC.optax(), jnp.float32, micro_batches=mb,
                                mesh=topology.data_mesh(jax.devices()[:n]), zero_stage=stage)
    return step, _train(step, setup)


def test_zero_ranks_equal_optax_on_the_token_mean(setup, zero):
    step, (state, losses) = zero
    _assert_equal_to_optax(step, state, losses, setup)


def test_batch_without_scored_tokens_refused_zero(setup, zero):
    step, (state, _) = zero
    _assert_refused_unchanged(step, state, setup)


def test_eval_loss_is_the_token_mean(setup, zero):
    """Evaluation over the ranks: the whole batch's mean over its scored tokens (0 for none)."""
    step, _ = zero
    state = step.init(setup["params"])  # the reference's first loss: batch 0's at the initial params
    np.testing.assert_allclose(float(step.eval_loss(state, setup["batches"][0])), setup["ref"][1][0], rtol=1e-6)
    assert float(step.eval_loss(state, -1 - jnp.abs(setup["batches"][0]))) == 0.0


def test_front_door_refuses_a_weighted_loss():
    """The front door (``chunkjax.offload``) takes a scalar loss: a WeightedLoss is refused in one
    line (its stages would read the weight as a side leaf)."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self):
            self.blocks = nnx.List([nnx.Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(2)])

        def __call__(self, x):
            for blk in self.blocks:
                x = blk(x)
            return x

    def loss_fn(model, b):
        return cj.WeightedLoss(jnp.sum(model(b) ** 2), jnp.float32(b.shape[0]))

    with pytest.raises(ValueError, match="loss_fn returns a WeightedLoss: return the scalar loss here") as e:
        cj.offload(Net(), optax.sgd(1e-3), loss_fn, jnp.ones((2, 4)), device_budget="64MiB")
    assert "\n" not in str(e.value)


def test_host_sums_weight_the_parts(monkeypatch):
    """HostSums with weights (a weighted loss): the mean is bit-equal to the float32 sum of each
    part's gradient times its weight, times 1 / the batch's weight, rounded to the compute dtype
    (blocks of a chunk larger than one; a part of weight 0 adds nothing)."""
    import ml_dtypes

    from chunkjax import accumulate
    monkeypatch.setattr(accumulate, "MEAN_BLOCK", 1000)
    n, size, rng = 3, 4567, np.random.default_rng(5)
    weights = [np.float32(7), np.float32(0), np.float32(12)]
    inv = np.float32(1.0) / np.float32(19)
    for dtype in (ml_dtypes.bfloat16, np.float32):
        grads = [{c: rng.standard_normal(size).astype(dtype) for c in range(2)} for _ in range(n)]
        sums = accumulate.HostSums(n, dtype, type("Whole", (), {"whole": staticmethod(np.asarray)})())
        futures = [sums.add(i, dict(g), jnp.asarray(w), jnp.asarray(inv) if i == n - 1 else None)
                   for i, (g, w) in enumerate(zip(grads, weights))][-1]
        sums.close()
        for c, f in futures.items():
            ref = sum(g[c].astype(np.float32) * w for g, w in zip(grads, weights))  # float32, in part order
            want = (ref * inv).astype(dtype)
            np.testing.assert_array_equal(f.result()[0].view(np.uint8), want.view(np.uint8))
