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
        for c in s.chunks:
            assert lay.chunk_trainable[c] == bool(jnp.issubdtype(s.dtype, jnp.floating)), s.path


def test_trainable_tree_never_mixes_frozen_and_trainable_leaves():
    t = _tree()
    mark = {"emb": False, "ids": False, "w": True, "mask": False, "b": True}
    lay = cj.build_layout(t, 1024, trainable=mark)
    by_path = {s.path: s for s in lay.slots}
    assert not set(by_path["emb"].chunks) & set(by_path["w"].chunks)  # same dtype, different trainability
    for p, tr in mark.items():
        assert {lay.chunk_trainable[c] for c in by_path[p].chunks} == {tr}
    back = lay.unpack(lay.pack(t))
    for k in t:
        assert back[k].dtype == t[k].dtype and np.array_equal(back[k], t[k])
    z = build_zero_layout(t, 8, 1000, trainable=mark)
    assert z.chunk_size % 8 == 0 and z.chunk_trainable == lay.chunk_trainable
    assert cj.search_chunk_size(t, trainable=mark) % 128 == 0


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


# ---- the engine: frozen chunks train nothing and keep their bits ------------------------------------

import optax  # noqa: E402

from chunkjax.host_update import AdamW  # noqa: E402
from chunkjax.stages import Stage  # noqa: E402
from models import gpt  # noqa: E402

STEPS, B, T = 20, 2, 16


def _embed(p, x, b):
    """The GPT embedding with the positions read from an int32 leaf (``pos``)."""
    del x
    tok = b[:, :-1]
    return p["wte"][tok] + p["wpe"][p["pos"][:tok.shape[1]]]


@pytest.fixture(scope="module")
def micro():
    """Micro GPT (2 blocks) with a frozen bf16 ``wpe``, a frozen block ``h_1`` and an int32 leaf."""
    cfg = gpt.get_config("micro", n_layers=2)
    rng = np.random.default_rng(7)
    params = jax.jit(gpt.init_params, static_argnums=0)(cfg, jax.random.key(int(rng.integers(1 << 30))))  # one program, not an eager compile per op
    params["wpe"] = params["wpe"].astype(jnp.bfloat16)
    params["pos"] = jnp.asarray(rng.permutation(cfg.seq_len), jnp.int32)
    stages = (Stage("embed", ("wte", "wpe", "pos"), _embed),) + gpt.gpt_stages(cfg)[1:]
    mark = jax.tree.map(lambda a: bool(jnp.issubdtype(a.dtype, jnp.floating)), params)
    mark["wpe"] = False
    mark["h_1"] = jax.tree.map(lambda _: False, params["h_1"])
    distinct = [jnp.asarray(rng.integers(0, cfg.vocab_size, (8, T + 1)), jnp.int32) for _ in range(4)]
    return cfg, params, stages, mark, [distinct[i % 4] for i in range(STEPS)]


_REF = {}


def _reference(micro, tx, rows=B, steps=STEPS, key=None):
    """Plain optax over the trainable leaves only (fp32), the frozen ones constants: ``(final
    params, losses (steps,))``. With ``key`` (naming the model and the transformation: an optax
    transformation has no stable identity) it is computed once per (key, rows, steps) and shared."""
    key = (key, rows, steps) if key is not None else object()
    if key not in _REF:
        _, params, stages, mark, batches = micro
        leaves, td = jax.tree.flatten(params)
        mask = td.flatten_up_to(mark)

        def merge(tr):
            it = iter(tr)
            return td.unflatten([next(it) if m else a for a, m in zip(leaves, mask)])

        @jax.jit
        def step(tr, o, b):
            l, g = jax.value_and_grad(lambda t: cj.compose_loss(stages, merge(t), b))(tr)
            u, o = tx.update(g, o, tr)
            return optax.apply_updates(tr, u), o, l

        tr = [a for a, m in zip(leaves, mask) if m]
        o, losses = tx.init(tr), []
        for b in batches[:steps]:
            tr, o, l = step(tr, o, b[:rows])
            losses.append(float(l))
        _REF[key] = merge(tr), np.asarray(losses)
    return _REF[key]


def _train(step, params, batches, rows=B):
    state, losses = step.init(params), []
    for b in batches:
        state, m = step(state, b[:rows])
        losses.append(float(m["loss"]))
    return state, np.asarray(losses)


def _check_frozen_bits(final, params, mark):
    for (path, a), p0, m in zip(jax.tree_util.tree_leaves_with_path(final), jax.tree.leaves(params),
                                jax.tree.leaves(mark)):
        if not m:
            a, p0 = np.asarray(a), np.asarray(p0)
            assert a.dtype == p0.dtype and np.array_equal(a, p0), jax.tree_util.keystr(path)


def _fit(micro, rows=B, **kw):
    _, params, stages, mark, batches = micro
    return cj.fit_step(stages, params, batches[0][:rows], compute_dtype=jnp.float32, trainable=mark,
                       device_budget="1GiB", resident=[], **kw)


def test_streamed_updates_equal_optax_on_the_trainable_leaves(micro):
    """``tx`` (streamed updates, clipping on), every param chunk in pinned_host: losses and
    trainable params equal plain optax over the trainable subset; frozen leaves bit-identical."""
    _, params, stages, mark, batches = micro
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(2e-3, weight_decay=0.1))
    step, report, problem = _fit(micro, tx=tx)
    lay = problem.layout
    assert not all(lay.chunk_trainable)
    assert set(report.schedule.param_kinds) == {cj.PINNED_HOST}
    assert {report.schedule.update_locations[c] for c in range(lay.n_chunks) if not lay.chunk_trainable[c]} == {"none"}
    state, losses = _train(step, params, batches)
    for c in step.frozen_chunks:
        assert state.master[c] is None and state.opt_state[c] is None
        assert state.params[c].dtype == lay.chunk_dtypes[c]
    ref, ref_losses = _reference(micro, tx)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    final = step.master_params(state)
    _check_frozen_bits(final, params, mark)
    for (path, a), b, m in zip(jax.tree_util.tree_leaves_with_path(final), jax.tree.leaves(ref), jax.tree.leaves(mark)):
        if m:
            a, b = np.asarray(a), np.asarray(b)
            assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-5, jax.tree_util.keystr(path)
    assert losses[-1] < losses[0]


@pytest.fixture(scope="module")
def host_run(micro):
    """The host kernel (AdamW, clipping far below the norm) with every param chunk in pinned_host."""
    _, params, stages, mark, batches = micro
    spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=0.05)
    step, report, problem = _fit(micro, host_optimizer=spec)
    state, losses = _train(step, params, batches)
    return spec, step, report, problem, state, losses


def test_host_updates_equal_optax_on_the_trainable_leaves(micro, host_run):
    _, params, stages, mark, batches = micro
    spec, step, report, problem, state, losses = host_run
    assert "host" in report.schedule.update_locations
    ref, ref_losses = _reference(micro, spec.optax())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    final = step.master_params(state)
    _check_frozen_bits(final, params, mark)
    for a, b, m in zip(jax.tree.leaves(final), jax.tree.leaves(ref), jax.tree.leaves(mark)):
        if m:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)
    exported = cj.export_params(step, state)
    _check_frozen_bits(exported, params, mark)


def test_predicted_bytes_of_a_frozen_chunk_are_its_params(micro, host_run):
    """A frozen chunk costs its params in their own dtype: no gradient, master or state in the
    prediction (host bytes, bytes moved) or in the host-memory check."""
    spec, step, report, problem, state, losses = host_run
    lay, cb, s = problem.layout, problem.cb, report.schedule
    frozen = [c for c in range(lay.n_chunks) if not lay.chunk_trainable[c]]
    assert frozen and all(cb.params_of(c) == lay.chunk_bytes(c) for c in frozen)
    trainable = lay.n_chunks - len(frozen)
    assert s.predicted.host_model_bytes == (trainable * (cb.params + cb.state + cb.grad)
                                            + sum(lay.chunk_bytes(c) for c in frozen))
    assert s.predicted.d2h_bytes_per_step == trainable * cb.grad
    fetches = [c for f in s.fetch for c in f]
    assert s.predicted.h2d_bytes_per_step == sum(cb.params_of(c) for c in fetches)
    frozen_bytes = sum(lay.chunk_bytes(c) for c in frozen)
    # host gradients: the working set of two programs (chunkjax.host_forms), not one per chunk
    assert 0 < s.predicted.host_working_bytes <= trainable * cb.grad
    assert report.host["pinned_host_bytes"] == trainable * cb.params + s.predicted.host_working_bytes + frozen_bytes
    assert report.host["pageable_bytes"] == trainable * cb.state
    assert report.host["pinned_host_bytes"] + report.host["pageable_bytes"] == s.predicted.host_bytes
    assert problem.model_chunk_bytes == trainable * (cb.params + cb.state) + sum(lay.chunk_bytes(c) for c in frozen)
    # a frozen chunk kept on the device costs its params there, nothing else
    resident = cj.fit.plan(problem, 2**30, resident=frozen[:1])
    assert resident.param_kinds[frozen[0]] == cj.DEVICE and resident.update_locations[frozen[0]] == "none"
    assert resident.predicted.device_model_bytes == lay.chunk_bytes(frozen[0])


def test_checkpoint_keeps_frozen_chunks(micro, host_run, tmp_path):
    """A checkpoint holds a frozen chunk's params only, in their dtype; restored, the run goes on
    with the same losses; export from the checkpoint keeps the frozen bits."""
    _, params, stages, mark, batches = micro
    spec, step, report, problem, state, losses = host_run
    cj.save_checkpoint(tmp_path / "ck", 1, step, state)
    restored, _ = cj.restore_checkpoint(tmp_path / "ck", step)
    for c in step.frozen_chunks:
        assert restored.master[c] is None
        assert np.array_equal(np.asarray(restored.params[c]), np.asarray(state.params[c]))
    a, ma = step(state, batches[0][:B])
    b, mb = step(restored, batches[0][:B])
    assert float(ma["loss"]) == float(mb["loss"])
    for x, y in zip(jax.tree.leaves(step.master_params(a)), jax.tree.leaves(step.master_params(b))):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    from chunkjax.checkpoint import export_checkpoint_params
    _check_frozen_bits(export_checkpoint_params(tmp_path / "ck", problem.layout), params, mark)
    lay2 = cj.build_layout(params, 2 * problem.layout.chunk_size, trainable=mark)
    other = cj.make_chunked_step(stages, lay2, cj.Placement.uniform(lay2.n_chunks, cj.DEVICE, cj.DEVICE),
                                 host_optimizer=spec)
    with pytest.raises(cj.CheckpointError, match="frozen chunks, which are not remapped"):
        cj.restore_checkpoint(tmp_path / "ck", other)


# ---- a LoRA-shaped model: adapters trainable, the base frozen -------------------------------------

V, D, R = 64, 32, 4


def _lora_model(seed=3):
    rng = np.random.default_rng(seed)
    nrm = lambda *s: jnp.asarray(0.1 * rng.standard_normal(s), jnp.float32)  # noqa: E731
    params = {"emb": nrm(V, D), "out": nrm(D, V), "perm": jnp.asarray(rng.permutation(V), jnp.int32)}
    for i in range(2):
        params[f"l{i}"] = {"w": nrm(D, D), "a": nrm(D, R), "b": jnp.zeros((R, D), jnp.float32)}

    def block(name):
        def apply(p, x, b):
            q = p[name]
            return x + jnp.tanh(x @ q["w"] + (x @ q["a"]) @ q["b"])
        return Stage(name, (name,), apply)

    def head(p, x, b):
        logits = x @ p["out"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, b[:, 1:]).mean()

    stages = (Stage("embed", ("emb", "perm"), lambda p, x, b: p["emb"][p["perm"][b[:, :-1]]]), block("l0"), block("l1"),
              Stage("head", ("out",), head))
    lora = jax.tree_util.tree_map_with_path(lambda path, _: jax.tree_util.keystr(path[-1:]) in ("['a']", "['b']"),
                                            params)
    batches = [jnp.asarray(rng.integers(0, V, (4, 9)), jnp.int32) for _ in range(4)]
    return params, stages, lora, [batches[i % 4] for i in range(STEPS)]


def _dots(jaxpr) -> int:
    """dot_general equations in a jaxpr and its sub-jaxprs."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "dot_general"
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _dots(inner)
    return n


def test_lora_trains_only_the_adapters():
    """Adapters trained (host AdamW, clipping, base chunks in pinned_host) equal optax on the
    adapters; the base is bit-identical and costs no weight-gradient matmul in the backward."""
    params, stages, lora, batches = _lora_model()
    spec = AdamW(1e-2, weight_decay=0.0, max_grad_norm=0.5)
    step, report, problem = cj.fit_step(stages, params, batches[0], host_optimizer=spec, compute_dtype=jnp.float32,
                                        trainable=lora, device_budget="1GiB", resident=[], chunk_size=2048)
    assert set(report.schedule.param_kinds) == {cj.PINNED_HOST}
    state, losses = _train(step, params, batches, rows=4)
    ref, ref_losses = _reference((None, params, stages, lora, batches), spec.optax(), rows=4, key=("lora", spec))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    final = step.master_params(state)
    _check_frozen_bits(final, params, lora)
    for a, b, m in zip(jax.tree.leaves(final), jax.tree.leaves(ref), jax.tree.leaves(lora)):
        if m:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)
    assert losses[-1] < losses[0]

    def dots(trainable):
        lay = cj.build_layout(params, 2048, trainable=trainable)
        n = lay.n_chunks
        s = cj.make_chunked_step(stages, lay, cj.Placement.uniform(n, cj.DEVICE, cj.DEVICE), optax.sgd(0.1),
                                 jnp.float32)
        bufs = [jax.ShapeDtypeStruct((lay.chunk_size,), jnp.float32) for _ in range(n)]
        return _dots(jax.make_jaxpr(s.fwd_bwd)(bufs, batches[0]).jaxpr)

    # per LoRA block the base's weight gradient x.T @ dy, and the head's: three matmuls fewer
    assert dots(lora) == dots(None) - 3


def test_lora_with_micro_batches_and_streamed_updates():
    """Gradient accumulation (2 micro-batches) with ``tx`` (streamed updates, clipping): the
    adapters equal optax on the whole batch, the base stays bit-identical."""
    params, stages, lora, batches = _lora_model()
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
    step, report, _ = cj.fit_step(stages, params, batches[0], tx=tx, compute_dtype=jnp.float32, trainable=lora,
                                  device_budget="1GiB", resident=[], chunk_size=2048, micro_batches=2)
    state, losses = _train(step, params, batches[:8], rows=4)
    _, ref_losses = _reference((None, params, stages, lora, batches), tx, rows=4, steps=8)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _check_frozen_bits(step.master_params(state), params, lora)


def test_lora_bf16_compute_reads_frozen_leaves_in_their_dtype():
    """bf16 compute: the frozen float32 base is cast to bf16 when read, the frozen int32 leaf is
    read as int32; frozen bits kept, the first loss within bf16 rounding of the fp32 reference."""
    params, stages, lora, batches = _lora_model()
    spec = AdamW(1e-2, weight_decay=0.0, max_grad_norm=0.5)
    step, _, problem = cj.fit_step(stages, params, batches[0], host_optimizer=spec, compute_dtype=jnp.bfloat16,
                                   trainable=lora, device_budget="1GiB", resident=[], chunk_size=2048)
    assert {np.dtype(problem.layout.chunk_dtypes[c]).name for c in step.frozen_chunks} == {"float32", "int32"}
    state, losses = _train(step, params, batches[:4], rows=4)
    # the 20-step fp32 run of test_lora_trains_only_the_adapters (same model, spec and rows): its first loss
    _, ref_losses = _reference((None, params, stages, lora, batches), spec.optax(), rows=4, key=("lora", spec))
    np.testing.assert_allclose(losses[0], ref_losses[0], rtol=1e-2)
    assert np.all(np.isfinite(losses))
    _check_frozen_bits(step.master_params(state), params, lora)
