"""The reported failures of /work/shared/cases/reported_failures.md, one test (family) per case.

Small models only (CPU, 2 cores): a 4-layer MLP written as stages and the ``micro`` GPT. Every
input is drawn fresh from a seeded generator. On the CPU backend both memory kinds exist and moves
compile to nothing, so placement tests prove the programs are well-formed and the values right.
"""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from chunkjax import (DEVICE, PINNED_HOST, Placement, PlanError, Stage, build_layout, chunk_bytes, compose_loss,
                      first_use_order, make_chunked_step, parse_bytes, plan_schedule, trace_stages)
from chunkjax.memory import sharding
from chunkjax.optim import state_bytes_per_chunk
from chunkjax.predict import fixed_rule_peak
from models.gpt import abstract_params, get_config, gpt_stages, loss_fn

F32, BF16 = jnp.float32, jnp.bfloat16


def to_device(arrays):
    dev = sharding(DEVICE)
    return [jax.device_put(a, dev) for a in arrays]


def chunked_grads(step, state, batch):
    """(loss, grads pytree, grad_sq) from the jitted chunked fwd_bwd."""
    loss, g, sq = step.jit_fwd_bwd(state.params, batch)
    return loss, step.layout.unpack(to_device(g)), sq


def assert_trees_close(got, want, rtol=1e-5, atol=1e-6):
    fg, tg = jax.tree_util.tree_flatten_with_path(got)
    fw, tw = jax.tree_util.tree_flatten_with_path(want)
    assert tg == tw
    for (p, a), (_, b) in zip(fg, fw):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        scale = float(np.max(np.abs(b))) or 1.0
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * scale, err_msg=jax.tree_util.keystr(p))


def placements(n):
    return {
        "all_device": Placement.uniform(n, DEVICE, DEVICE),
        "all_host": Placement.uniform(n, PINNED_HOST, PINNED_HOST),
        "mixed": Placement.from_device_chunks(n, range(1, n, 2)),
        "params_host_state_device": Placement.uniform(n, PINNED_HOST, DEVICE),
    }


# ---- a 4-layer MLP whose layers 1 and 3 share one weight (case 1) ------------------------------

D_IN, H, B = 5, 8, 6


def mlp_stages():
    return (
        Stage("l0", ("w0",), lambda p, x, b: jnp.tanh(b[:, :D_IN] @ p["w0"])),
        Stage("l1", ("shared",), lambda p, x, b: jnp.tanh(x @ p["shared"])),
        Stage("l2", ("w2", "b2"), lambda p, x, b: jnp.tanh(x @ p["w2"] + p["b2"])),
        Stage("l3", ("shared",), lambda p, x, b: jnp.mean((x @ p["shared"] - b[:, D_IN:]) ** 2)),
    )


def mlp_params(seed):
    k = jax.random.split(jax.random.key(seed), 4)
    return {"w0": jax.random.normal(k[0], (D_IN, H)), "shared": jax.random.normal(k[1], (H, H)) / 2,
            "w2": jax.random.normal(k[2], (H, H)) / 2, "b2": jax.random.normal(k[3], (H,))}


def mlp_batch(seed):
    return jax.random.normal(jax.random.key(seed), (B, D_IN + H))


MLP_STAGES = mlp_stages()
# plain references, jitted once per module (batch is an argument, so they compile once)
mlp_value_and_grad = jax.jit(jax.value_and_grad(lambda p, b: compose_loss(MLP_STAGES, p, b)))


def mlp_order(params):
    return first_use_order(lambda p, b: compose_loss(MLP_STAGES, p, b), params, mlp_batch(0))


@jax.jit
def shared_grad_parts(params, batch):
    """Gradient of ``shared`` from its use in layer 1 and from its use in layer 3, separately."""
    def split_loss(p, shared_l3):
        x = None
        for i, s in enumerate(MLP_STAGES):
            sub = {k: (shared_l3 if (i == 3 and k == "shared") else p[k]) for k in s.param_keys}
            x = s.apply(sub, x, batch)
        return x

    g, g3 = jax.grad(split_loss, argnums=(0, 1))(params, params["shared"])
    return g["shared"], g3


# chunk sizes: 64 puts `shared` alone in its chunk; 104 shares its chunk with w0 (a chunk read by
# stages 0, 1 and 3); 176 puts the whole model in one chunk
@pytest.mark.parametrize("chunk_size", [64, 104, 176])
@pytest.mark.parametrize("placement", ["all_device", "mixed"])  # mixed with one chunk: all host
def test_case1_shared_weight_gradients(chunk_size, placement):
    params, batch = mlp_params(1), mlp_batch(2)
    lay = build_layout(params, chunk_size, mlp_order(params))
    shared_chunk, = {s.path: s.chunks for s in lay.slots}["shared"]
    mates = [s.path for s in lay.chunk_leaves(shared_chunk) if s.path != "shared"]
    assert (len(mates) == 0) == (chunk_size == 64)
    step = make_chunked_step(MLP_STAGES, lay, placements(lay.n_chunks)[placement], optax.sgd(0.1), F32)
    state = step.init(params)
    loss, got, sq = chunked_grads(step, state, batch)
    want_loss, want = mlp_value_and_grad(params, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    assert_trees_close(got, want)
    # the shared gradient really arrives in two sizeable parts, and both were summed
    g1, g3 = shared_grad_parts(params, batch)
    assert float(jnp.linalg.norm(g1)) > 1e-2 and float(jnp.linalg.norm(g3)) > 1e-2
    assert_trees_close(got["shared"], g1 + g3)
    assert not np.allclose(np.asarray(got["shared"]), np.asarray(g3), rtol=1e-2)
    # squared norm per chunk
    want_sq = lay.pack(jax.tree.map(lambda a: a.astype(F32), want), dtype=F32)
    np.testing.assert_allclose(np.asarray(sq), [float(jnp.sum(c ** 2)) for c in want_sq], rtol=1e-5)


# all-device and all-host placements train in test_case4 too
@pytest.mark.parametrize("placement", ["mixed", "params_host_state_device"])
@pytest.mark.parametrize("tx_name", ["sgd", "clip_adam"])
def test_case1_shared_weight_training_matches_optax(placement, tx_name):
    make_tx = {"sgd": lambda: optax.sgd(0.1),
               "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))}[tx_name]
    params = mlp_params(3)
    lay = build_layout(params, 64, mlp_order(params))
    step = make_chunked_step(MLP_STAGES, lay, placements(lay.n_chunks)[placement], make_tx(), F32)
    state = step.init(params)
    tx = make_tx()
    ref, opt = params, tx.init(params)
    for i in range(3):
        batch = mlp_batch(100 + i)
        state, metrics = step(state, batch)
        loss, g = mlp_value_and_grad(ref, batch)
        upd, opt = tx.update(g, opt, ref)
        ref = optax.apply_updates(ref, upd)
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
        np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.tree.norm(g)), rtol=1e-5)
        assert_trees_close(step.master_params(state), ref)
    assert not np.allclose(np.asarray(ref["shared"]), np.asarray(params["shared"]))


# ---- the micro GPT (cases 2, 8, 9, 18) ---------------------------------------------------------------

GPT_BATCH = (2, 9)  # (B, T+1)


@pytest.fixture(scope="module")
def gpt():
    # the micro GPT's widths, vocabulary and positions with 1 of its 4 blocks: every stage kind
    # (embed, block, tied head) is there and the file stays fast on a 2-core CPU
    cfg = get_config("micro", n_layers=1)
    rng = np.random.default_rng(5)
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(1.0 if a.ndim == 1 else 0.0, 0.05, a.shape), F32),
                          abstract_params(cfg))
    batch_sds = jax.ShapeDtypeStruct(GPT_BATCH, jnp.int32)
    order = first_use_order(lambda p, b: loss_fn(cfg, p, b), params, batch_sds)
    lay = build_layout(params, cfg.vocab_size * cfg.d_model, order)  # wte fills chunk 0
    return {"cfg": cfg, "params": params, "stages": gpt_stages(cfg), "layout": lay, "batch_sds": batch_sds}


@pytest.fixture(scope="module")
def gpt_mixed_step(gpt):
    """Chunked step of the micro GPT in float32 with a mixed placement (wte's chunk on the host)."""
    lay = gpt["layout"]
    pl = placements(lay.n_chunks)["mixed"]
    assert pl.param_kinds[0] == PINNED_HOST and DEVICE in pl.param_kinds
    return make_chunked_step(gpt["stages"], lay, pl, optax.adam(1e-3), F32)


def gpt_batch(seed, cfg):
    return jax.random.randint(jax.random.key(seed), GPT_BATCH, 0, cfg.vocab_size, dtype=jnp.int32)


def test_case2_tied_embedding(gpt, gpt_mixed_step):
    cfg, params, lay, stages = gpt["cfg"], gpt["params"], gpt["layout"], gpt["stages"]
    paths = [s.path for s in lay.slots]
    assert paths.count("wte") == 1 and len(set(paths)) == len(paths)
    assert lay.n_elements == cfg.n_params  # the tied matrix is stored once
    assert sum(1 for st in stages if "wte" in st.param_keys) == 2  # ... and read by two stages
    batch = gpt_batch(6, cfg)
    state = gpt_mixed_step.init(params)
    loss, got, sq = chunked_grads(gpt_mixed_step, state, batch)

    # reference: the embedding use and the LM-head use as separate arguments
    def split_loss(p, wte_head):
        x = None
        for st in stages:
            sub = {k: (wte_head if (st.name == "head" and k == "wte") else p[k]) for k in st.param_keys}
            x = st.apply(sub, x, batch)
        return x

    (ref_loss, (g, g_head)) = jax.jit(jax.value_and_grad(split_loss, argnums=(0, 1)))(params, params["wte"])
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    g_emb = g["wte"]
    assert float(jnp.linalg.norm(g_emb)) > 1e-3 and float(jnp.linalg.norm(g_head)) > 1e-3
    want = dict(g, wte=g_emb + g_head)  # what jax.grad of loss_fn gives: both uses summed
    assert_trees_close(got, want)
    assert not np.allclose(np.asarray(got["wte"]), np.asarray(g_head), rtol=1e-2, atol=0)
    want_sq = [float(jnp.sum(c ** 2)) for c in lay.pack(want, dtype=F32)]
    np.testing.assert_allclose(np.asarray(sq), want_sq, rtol=1e-5)


def test_case18_mixed_placement_compiles_and_exports(gpt, gpt_mixed_step):
    step, lay, cfg = gpt_mixed_step, gpt["layout"], gpt["cfg"]
    state = step.init(gpt["params"])
    kinds = [p.sharding.memory_kind for p in state.params]
    assert {DEVICE, PINNED_HOST} <= set(kinds)
    assert len({(p.shape, p.dtype) for p in state.params}) == 1  # same-shaped buffers side by side
    batch = gpt_batch(7, cfg)
    lowered = step.jit_fwd_bwd.lower(state.params, batch)
    assert "pinned_host" in lowered.as_text()
    compiled = lowered.compile()
    loss, grads, sq = compiled(state.params, batch)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(sq)))
    assert [g.sharding.memory_kind for g in grads] == [step.placement.grad_kind(c) for c in range(lay.n_chunks)]
    # a whole step (device group update + streamed updates) runs and trains
    new, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    assert [p.sharding.memory_kind for p in new.params] == kinds
    _, metrics2 = step(new, batch)
    assert float(metrics2["loss"]) < float(metrics["loss"])
    # export for the GPU from abstract arguments that carry their memory kinds
    args = (tuple(jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=p.sharding) for p in state.params),
            jax.ShapeDtypeStruct(batch.shape, batch.dtype, sharding=sharding(DEVICE)))
    exp = jax.export.export(step.jit_fwd_bwd, platforms=("cuda",))(*args)
    text = exp.mlir_module()
    assert "stablehlo" in text and "pinned_host" in text
    assert exp.platforms == ("cuda",)


@pytest.fixture(scope="module")
def gpt_plan(gpt):
    lay = gpt["layout"]
    traces = trace_stages(gpt["stages"], lay, gpt["batch_sds"], F32)
    cb = chunk_bytes(lay, F32, state_bytes_per_chunk(optax.adam(1e-3), lay.chunk_size))
    return lay, traces, cb


def _need(lay, traces, cb, kind, prefetch):
    pl = Placement.uniform(lay.n_chunks, kind, kind)
    return fixed_rule_peak(lay.chunk_size, traces, cb, pl, prefetch)


def fixed_rule(lay, traces, cb, budget, prefetch=1):
    """The fixed rule (plan_schedule's ``"fixed"`` policy): (placement, prediction)."""
    s = plan_schedule(lay, traces, cb, budget, policy="fixed", prefetch=prefetch)
    return s.placement, s.predicted


@pytest.mark.parametrize("prefetch", [1, 2])
def test_case8_plan_never_exceeds_budget(gpt_plan, prefetch):
    lay, traces, cb = gpt_plan
    n = lay.n_chunks
    host_need = _need(lay, traces, cb, PINNED_HOST, prefetch)
    dev_need = _need(lay, traces, cb, DEVICE, prefetch)
    assert 0 < host_need < dev_need
    rng = np.random.default_rng(prefetch)
    budgets = sorted({host_need, dev_need, 2 * dev_need,
                      *np.linspace(host_need, dev_need, 12).astype(int).tolist(),
                      *rng.integers(host_need, dev_need, size=12).tolist()})
    prev = -1
    for budget in budgets:
        pl, acc = fixed_rule(lay, traces, cb, budget, prefetch)
        assert acc.peak_device_bytes <= budget
        assert acc.peak_device_bytes == fixed_rule_peak(lay.chunk_size, traces, cb, pl, prefetch)  # of the placement returned
        p_on = [c for c in range(n) if pl.param_kinds[c] == DEVICE]
        s_on = [c for c in range(n) if pl.state_kinds[c] == DEVICE]
        assert acc.device_model_bytes == len(p_on) * cb.params + len(s_on) * cb.state
        assert acc.device_model_bytes >= prev, f"budget {budget}: fewer bytes on the device than a smaller budget"
        prev = acc.device_model_bytes
        # the plan is maximal: no compute-param chunk or state chunk left on the host would still fit
        for c in set(range(n)) - set(p_on):
            pk = tuple(DEVICE if (k == DEVICE or j == c) else PINNED_HOST for j, k in enumerate(pl.param_kinds))
            assert fixed_rule_peak(lay.chunk_size, traces, cb, Placement(pk, pl.state_kinds), prefetch) > budget
        for c in set(range(n)) - set(s_on):
            sk = tuple(DEVICE if (k == DEVICE or j == c) else PINNED_HOST for j, k in enumerate(pl.state_kinds))
            assert fixed_rule_peak(lay.chunk_size, traces, cb, Placement(pl.param_kinds, sk), prefetch) > budget
        if budget >= dev_need:
            assert pl == Placement.uniform(n, DEVICE, DEVICE)
    assert prev > 0


@pytest.mark.parametrize("prefetch", [1, 2])
def test_case8_infeasible_budget_names_smallest(gpt_plan, prefetch):
    lay, traces, cb = gpt_plan
    host_need = _need(lay, traces, cb, PINNED_HOST, prefetch)
    fixed_rule(lay, traces, cb, host_need, prefetch)  # exactly the need: fits
    for budget in (host_need - 1, host_need * 3 // 4):
        with pytest.raises(PlanError) as ei:
            fixed_rule(lay, traces, cb, budget, prefetch)
        e = ei.value
        assert e.min_budget_bytes == host_need
        assert not e.activations_alone
        msg = str(e)
        assert "iB" in msg and "\n" not in msg and str(host_need) in msg
        assert "activations alone" not in msg
        # the budget the message suggests, in the unit that fits it (chunkjax.errors.format_bytes), must itself work
        m = re.search(r">=\s*([0-9.]+\s*[KMGT]iB)", msg)
        assert m, msg
        suggested = parse_bytes(m.group(1))
        assert suggested >= host_need, (m.group(1), host_need)
        fixed_rule(lay, traces, cb, suggested, prefetch)


def test_case9_activations_alone_exceed_budget(gpt_plan):
    lay, traces, cb = gpt_plan
    act = sum(t.input_bytes for t in traces[1:]) + max(t.temp_bytes for t in traces)
    assert act > 0
    for budget in (act - 1, act // 3, 1):
        with pytest.raises(PlanError) as ei:
            fixed_rule(lay, traces, cb, budget)
        e = ei.value
        assert e.activations_alone
        assert e.min_budget_bytes == _need(lay, traces, cb, PINNED_HOST, 1)
        msg = str(e)
        assert "activations alone" in msg and "batch" in msg and "\n" not in msg


# ---- case 4: parameters that get no gradient -------------------------------------------------------

def frozen_stages():
    return (
        Stage("s0", ("w", "frozen_sg"),
              lambda p, x, b: jnp.tanh(b[:, :4] @ p["w"] + jax.lax.stop_gradient(p["frozen_sg"]))),
        Stage("s1", ("frozen_zero", "v"),
              lambda p, x, b: jnp.mean((x @ (p["frozen_zero"] * 0.0) + x * p["v"] - b[:, 4:]) ** 2)),
    )


FROZEN_STAGES = frozen_stages()
frozen_grad = jax.jit(jax.grad(lambda p, b: compose_loss(FROZEN_STAGES, p, b)))


def frozen_params(seed):
    k = jax.random.split(jax.random.key(seed), 5)
    return {"w": jax.random.normal(k[0], (4, 8)), "frozen_sg": jax.random.normal(k[1], (8,)),
            "frozen_zero": jax.random.normal(k[2], (8, 8)), "v": jax.random.normal(k[3], (8,)),
            "unused": jax.random.normal(k[4], (60,))}


NO_GRAD = ("frozen_sg", "frozen_zero", "unused")


# chunk 64: `unused` sits alone in a chunk no stage reads (4 chunks, mixed: 1 and 3 on the
# device); 256: every leaf in one chunk (mixed: all on the host)
@pytest.mark.parametrize("tx_name,chunk_size,placement", [
    ("sgd", 64, "mixed"), ("sgd", 64, "all_device"), ("sgd", 256, "mixed"),
    ("adamw", 64, "mixed"), ("adamw", 256, "mixed")])
def test_case4_no_gradient_params_untouched(tx_name, chunk_size, placement):
    make_tx = {"sgd": lambda: optax.sgd(0.1), "adamw": lambda: optax.adamw(1e-2, weight_decay=0.0)}[tx_name]
    params, stages = frozen_params(8), FROZEN_STAGES
    batch0 = jax.random.normal(jax.random.key(9), (B, 12))
    order = first_use_order(lambda p, b: compose_loss(stages, p, b), params, batch0)
    assert order[-1] == "unused"
    lay = build_layout(params, chunk_size, order)
    chunk_of = {s.path: s.chunks[0] for s in lay.slots}  # every leaf fits one chunk here
    if chunk_size == 64:
        assert [s.path for s in lay.chunk_leaves(chunk_of["unused"])] == ["unused"]
    step = make_chunked_step(stages, lay, placements(lay.n_chunks)[placement], make_tx(), F32)
    state = step.init(params)
    _, got, sq = chunked_grads(step, state, batch0)
    want = frozen_grad(params, batch0)
    for k in NO_GRAD:
        assert np.all(np.asarray(want[k]) == 0)  # the reference agrees
        assert np.all(np.asarray(got[k]) == 0), k
    for k in ("w", "v"):
        assert float(jnp.linalg.norm(got[k])) > 0
    assert_trees_close(got, want)
    if chunk_size == 64:
        assert float(sq[chunk_of["unused"]]) == 0.0
    for i in range(3):
        state, _ = step(state, jax.random.normal(jax.random.key(10 + i), (B, 12)))
    master = step.master_params(state)
    compute = step.layout.unpack(to_device(state.params))
    for k in NO_GRAD:
        np.testing.assert_array_equal(np.asarray(master[k]).view(np.uint32), np.asarray(params[k]).view(np.uint32))
        np.testing.assert_array_equal(np.asarray(compute[k]).view(np.uint32), np.asarray(params[k]).view(np.uint32))
    for k in ("w", "v"):
        assert not np.allclose(np.asarray(master[k]), np.asarray(params[k]))
    # optimizer moments (chunk-sized state leaves) stay zero at the no-gradient slots
    slots = {s.path: s for s in lay.slots}
    n_moment_leaves = 0
    for c in range(lay.n_chunks):
        moments = [np.asarray(jax.device_put(x, sharding(DEVICE))) for x in jax.tree.leaves(state.opt_state[c])
                   if x.shape == (lay.chunk_size,)]
        n_moment_leaves += len(moments)
        for k in NO_GRAD:
            for p in slots[k].pieces:
                if p.chunk == c:
                    for m in moments:
                        assert not m[p.offset:p.offset + p.size].any()
    assert n_moment_leaves == (2 * lay.n_chunks if tx_name == "adamw" else 0)


# ---- case 17: no user-visible array in pinned host memory -----------------------------------------

def test_case17_master_params_indexable_from_host_state():
    params = mlp_params(12)
    lay = build_layout(params, 64, mlp_order(params))
    step = make_chunked_step(MLP_STAGES, lay, placements(lay.n_chunks)["all_host"], optax.adam(1e-3), F32)
    state = step.init(params)
    assert all(m.sharding.memory_kind == PINNED_HOST for m in state.master)
    master = step.master_params(state)
    for path, leaf in jax.tree_util.tree_flatten_with_path(master)[0]:
        assert leaf.sharding.memory_kind == DEVICE, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(np.asarray(master["w0"][0]), np.asarray(params["w0"][0]))
    np.testing.assert_array_equal(np.asarray(master["shared"][1:3, ::2]), np.asarray(params["shared"][1:3, ::2]))
    batch = mlp_batch(13)
    np.testing.assert_allclose(float(step.eval_loss(state, batch)),
                               float(compose_loss(MLP_STAGES, params, batch)), rtol=1e-6)


# ---- a model of one stage (first and last at once) -----------------------------------------------

@pytest.mark.parametrize("placement", ["all_device", "all_host"])
def test_single_stage_model(placement):
    params = {"w": jax.random.normal(jax.random.key(14), (D_IN, H)), "b": jax.random.normal(jax.random.key(15), (H,))}
    stages = (Stage("only", ("w", "b"), lambda p, x, b: jnp.mean((b[:, :D_IN] @ p["w"] + p["b"] - b[:, D_IN:]) ** 2)),)
    lay = build_layout(params, 48)
    step = make_chunked_step(stages, lay, placements(lay.n_chunks)[placement], optax.sgd(0.1), F32)
    state = step.init(params)
    batch = mlp_batch(16)
    loss, got, _ = chunked_grads(step, state, batch)
    want_loss, want = jax.value_and_grad(lambda p: compose_loss(stages, p, batch))(params)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    assert_trees_close(got, want)


# ---- a batch that is a pytree (the Stage contract does not restrict the batch) --------------------

def test_dict_batch():
    params = mlp_params(17)
    stages = (Stage("in", ("w0",), lambda p, x, b: jnp.tanh(b["x"] @ p["w0"])),
              Stage("out", ("w2", "b2"), lambda p, x, b: jnp.mean((x @ p["w2"] + p["b2"] - b["y"]) ** 2)))
    params = {k: params[k] for k in ("w0", "w2", "b2")}
    lay = build_layout(params, 64)
    step = make_chunked_step(stages, lay, placements(lay.n_chunks)["mixed"], optax.sgd(0.1), F32)
    state = step.init(params)
    raw = mlp_batch(18)
    batch = {"x": raw[:, :D_IN], "y": raw[:, D_IN:]}
    loss, got, _ = chunked_grads(step, state, batch)
    want_loss, want = jax.value_and_grad(lambda p: compose_loss(stages, p, batch))(params)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    assert_trees_close(got, want)


# ---- parse_bytes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text,want", [
    ("8GiB", 8 * 2**30), ("512MiB", 512 * 2**20), ("24GB", 24 * 10**9), ("1.5GiB", 3 * 2**29),
    ("123", 123), ("1e9", 10**9), (" 8 gib ", 8 * 2**30), ("64KiB", 65536), ("2TB", 2 * 10**12), ("7B", 7),
])
def test_parse_bytes(text, want):
    got = parse_bytes(text)
    assert got == want and isinstance(got, int)


@pytest.mark.parametrize("text", ["abc", "-1GiB", "8XB", "", "0", "GiB", "nan", "inf", "1e999GiB", "8 G i B x", "1e99", "2000TiB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError) as ei:
        parse_bytes(text)
    msg = str(ei.value)
    assert "\n" not in msg and repr(text) in msg and "GiB" in msg


def test_budget_above_any_machine_is_refused_not_planned():
    """A fresh user's ``device_budget=1e99`` planned and trained, printing a 90-digit MiB count: a
    number beyond :data:`chunkjax.budget.MAX_BYTES` is a typo, refused in one line; 1 PiB itself parses."""
    from chunkjax.budget import MAX_BYTES, parse_budget
    for bad in (1e99, 10**20, "1e99", MAX_BYTES + 1):
        with pytest.raises(ValueError, match="PiB any machine has") as ei:
            parse_budget(bad)
        assert "\n" not in str(ei.value)
    assert parse_budget(MAX_BYTES) == MAX_BYTES == parse_bytes("1024TiB")


# ---- case 10: pinned host memory is budgeted, reported and checked against the runtime's cap -------

def test_case10_pinned_host_cap_detected_and_explained():
    """The GPU runtime caps pinned host memory at 64 GiB unless XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB
    says otherwise; a plan above the cap is refused before anything is allocated, with the value
    to set. On the CPU pinned_host is ordinary memory: no cap."""
    from chunkjax import host_memory as memory
    assert memory.pinned_host_limit_bytes("gpu", {}) == 64 * 2**30
    assert memory.pinned_host_limit_bytes("gpu", {"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "200"}) == 200 * 2**30
    assert memory.pinned_host_limit_bytes("cpu", {}) is None
    memory.check_pinned_host(int(0.9 * 64 * 2**30), "gpu", {})  # 90 % of the cap: fits
    memory.check_pinned_host(10**15, "cpu", {})      # no cap on the CPU
    # at the cap it does not: the pool fragments (GPT3_15B on the H200 failed a 101 MiB allocation
    # with its pinned peak at 0.95 of the cap, session 15)
    with pytest.raises(PlanError, match="pool fragments"):
        memory.check_pinned_host(64 * 2**30, "gpu", {})
    with pytest.raises(PlanError) as e:
        memory.check_pinned_host(80 * 2**30, "gpu", {})
    msg = str(e.value)
    assert "cap of 64 GiB (the default, XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB unset" in msg
    assert "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=89 " in msg and "\n" not in msg  # 80 GiB / 0.9, rounded up
    memory.check_pinned_host(80 * 2**30, "gpu", {"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "89"})  # what it says fits
    with pytest.raises(PlanError, match="XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=100; the pool fragments"):
        memory.check_pinned_host(101 * 2**30, "gpu", {"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "100"})


def test_case10_step_counts_its_pinned_bytes_and_refuses_before_allocating(gpt, gpt_mixed_step, monkeypatch):
    from chunkjax import host_memory as memory
    lay, pl, step = gpt["layout"], gpt_mixed_step.placement, gpt_mixed_step
    cs = lay.chunk_size
    opt = state_bytes_per_chunk(optax.adam(1e-3), cs)
    want = sum(cs * 4 * (pl.param_kinds[c] == PINNED_HOST) + cs * 4 * (pl.grad_kind(c) == PINNED_HOST)
               + (4 * cs + opt) * (pl.state_kinds[c] == PINNED_HOST) for c in range(lay.n_chunks))
    assert want > 0 and step.pinned_host_bytes() == want
    allocated = []
    monkeypatch.setattr(memory, "pinned_host_limit_bytes", lambda platform, env=None: want - 1)
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: allocated.append(a) or (_ for _ in ()).throw(AssertionError))
    with pytest.raises(PlanError, match="pinned host memory"):
        step.init(gpt["params"])
    assert allocated == []


# ---- case 14: a staging-buffer pool that runs dry: back-pressure or a clear error, never a hang ------

def test_case14_staging_pool_runs_dry_without_hanging(tmp_path, monkeypatch):
    """The disk tier's fixed pool (3 buffers) serves 64 chunks whose writes are slow: readers wait
    for a free buffer (back-pressure) and every chunk is right; a write that fails while every
    buffer is taken raises StorageError promptly (no thread left waiting); too small a pool is
    refused at construction."""
    import errno
    import threading
    import time

    from chunkjax.storage import files as storage
    from chunkjax.storage import DiskTier, StorageError

    sizes = [257] * 64
    tier = DiskTier([tmp_path / "a", tmp_path / "b"], sizes, n_buffers=3)
    tier.initialize(lambda c: np.full(257, float(c), np.float32))
    real = storage._pwrite

    def slow(fd, data, offset):
        time.sleep(0.002)
        return real(fd, data, offset)

    monkeypatch.setattr(storage, "_pwrite", slow)
    tier.update(lambda c, v: v[0].__iadd__(1.0))
    assert tier.staging_bytes == 3 * 3 * storage.section_bytes(257)
    for c in (0, 31, 63):
        np.testing.assert_array_equal(tier.read_chunk(c)[0], np.full(257, c + 1.0, np.float32))
    calls = {"n": 0}

    def fail_later(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > 10:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, data, offset)

    monkeypatch.setattr(storage, "_pwrite", fail_later)
    box = {}
    t = threading.Thread(target=lambda: box.update(r=_raises(lambda: tier.update(lambda c, v: v[0].__iadd__(1.0)))))
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "the update hung with a failed write and a dry pool"
    assert isinstance(box["r"], StorageError) and "\n" not in str(box["r"])
    assert tier.committed_step == 1
    monkeypatch.setattr(storage, "_pwrite", real)
    np.testing.assert_array_equal(tier.read_chunk(5)[0], np.full(257, 6.0, np.float32))
    tier.close()
    with pytest.raises(ValueError, match="n_buffers >= read_ahead \\+ 2"):
        DiskTier([tmp_path / "c"], [8], n_buffers=2)


def _raises(fn):
    try:
        fn()
    except Exception as e:  # returned for the assertion in the main thread
        return e
    return None


# ---- case 16: the whole storage configuration is validated before anything is allocated ------------

def test_case16_storage_configuration_validated_before_anything_starts(tmp_path):
    import multiprocessing

    from chunkjax.host_update import AdamW
    from chunkjax.storage.baseline import BaselineOptimizer
    from chunkjax.storage.near import NearStorageOptimizer

    a_file = tmp_path / "file"
    a_file.write_text("x")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    spec, sizes, init = AdamW(1e-3), [8, 8], {0: np.zeros(8), 1: np.zeros(8)}
    ok = str(tmp_path / "new" / "d0")
    cases = [
        (dict(dirs=[]), "no storage directories"),
        (dict(dirs=str(tmp_path / "d")), "pass a list of directories"),
        (dict(dirs=[ok, ok]), "is given twice"),
        (dict(dirs=[str(a_file)]), "is a file"),
        (dict(dirs=[str(a_file / "sub")]), r"cannot be created \('.*file' is a file, not a directory\)"),
        (dict(dirs=[ok], n_buffers=2), ">= 3 staging buffers"),
        (dict(dirs=[ok], compression="zstd"), "compression must be"),
        (dict(dirs=[ok], compression="topk", topk_ratio=0.0), "ratio"),
    ]
    if os.geteuid() != 0:  # root writes anywhere
        cases.append((dict(dirs=[str(ro / "d")]), "cannot be created"))
    before = set(multiprocessing.active_children())  # an earlier test's worker may still be exiting
    for kw, needle in cases:
        with pytest.raises(ValueError, match=needle) as e:
            NearStorageOptimizer(kw.pop("dirs"), sizes, spec, init_params=init, **kw)
        assert "\n" not in str(e.value)
        assert set(multiprocessing.active_children()) <= before  # no worker was started
        assert not (tmp_path / "new").exists()  # nothing was created
    with pytest.raises(ValueError, match="is a file"):
        BaselineOptimizer([str(a_file)], sizes, spec, init_params=init)


# ---- case 13: state on disk over many steps: stable names, no orphan files ----------------------------

def test_case13_disk_state_keeps_stable_names_and_no_orphans(tmp_path):
    """25 steps of the disk tier: each directory holds its manifest and at most two generations of
    its chunk files (the committed step and the one before, kept until the next step starts), all
    named chunk<c>.step<s>.bin; reopening continues bit-exactly (resume with state on disk is
    tests/test_storage.py::test_worker_killed_mid_step_then_resume)."""
    import re as _re

    from chunkjax.storage import DiskTier

    dirs, sizes = [tmp_path / "a", tmp_path / "b"], [300, 7, 511, 1]
    tier = DiskTier(dirs, sizes)
    tier.initialize(lambda c: np.full(sizes[c], 0.5, np.float32))
    for _ in range(25):
        tier.update(lambda c, v: v[0].__iadd__(1.0))
    tier.close()
    for i, d in enumerate(dirs):
        files = sorted(os.listdir(d))
        chunks = [f for f in files if f != "manifest.json"]
        assert "manifest.json" in files
        assert all(_re.fullmatch(r"chunk\d{7}\.step\d{9}\.bin", f) for f in chunks), chunks
        steps = {int(f.split(".step")[1][:9]) for f in chunks}
        assert steps <= {24, 25} and 25 in steps, steps
        assert len(chunks) <= 2 * sum(1 for c in range(len(sizes)) if c % 2 == i)
    with DiskTier(dirs, sizes) as t:
        assert t.committed_step == 25
        for c, n in enumerate(sizes):
            np.testing.assert_array_equal(t.read_chunk(c)[0], np.full(n, 25.5, np.float32))


# ---- donation across memory kinds (the kind of cases 18 and 19) --------------------------------

def test_donated_accumulator_with_gradient_to_pinned_host():
    """A program that emits a host chunk's gradient to pinned_host from a cross-program accumulator
    (the tied embedding: read by the first and the last stage) must not donate that accumulator:
    jax aliased the donated device buffer with the pinned_host output and the executable then
    expected it in host memory (first seen on the H200 with every chunk host-updated:
    "RuntimeProgramInputMismatch ... parameter 2 in an unexpected memory space 'device'"; on the
    CPU "PjRtBuffer's memory kind does not match"). With donation on, the steps run and equal the
    undonated steps bit for bit."""
    import dataclasses

    from chunkjax.host_update import AdamW
    from chunkjax.plan import plan_schedule
    cfg = get_config("micro", n_layers=1)  # embed, one block, the tied head: the accumulator crosses programs
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    params = jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape)).astype(np.float32), abstract_params(cfg))
    batches = [jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 17)), jnp.int32) for _ in range(3)]
    stages = gpt_stages(cfg)
    order = first_use_order(lambda p, b: compose_loss(stages, p, b), params, batches[0])
    lay = build_layout(params, None, order, min_chunks=6)
    spec = AdamW(learning_rate=3e-3)
    probe = make_chunked_step(stages, lay, Placement.uniform(lay.n_chunks, DEVICE, DEVICE), spec.optax(), F32)
    cb = chunk_bytes(lay, F32, state_bytes_per_chunk(spec.optax(), lay.chunk_size))
    sched = plan_schedule(lay, probe.traces(batches[0]), cb, 10**12, flops_per_step=1, resident=[])  # all host
    runs = {}
    for donate in (False, True):
        step = dataclasses.replace(make_chunked_step(stages, lay, sched, host_optimizer=spec, compute_dtype=F32),
                                   donate=donate)
        assert step._donates is donate
        state, losses = step.init(params), []
        for b in batches:
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        step.wait(state)
        runs[donate] = (losses, [np.asarray(x) for x in state.master])
    assert len(step.program_bounds()) > 1  # gradients cross programs through the accumulators
    assert runs[True][0] == runs[False][0]
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        np.testing.assert_array_equal(a, b)
