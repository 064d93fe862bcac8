"""What a new user found bringing their own model (a tied-embedding MoE-ish decoder, an
ALBERT-style module shared by every block, an int32 Param, a scalar leaf) to chunkjax (helper
``fresh26``, session 26).

Each test asserts the right value or behaviour against a reference (plain optax, float32 on the
CPU) or the documented one-line error."""
import multiprocessing

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import chunkjax as cj
from chunkjax.host_update import AdamW


class _Block(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(64, 64, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.fc(x))


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(32, 64, rngs=rngs)
        self.blocks = nnx.List([_Block(rngs) for _ in range(3)])

    def __call__(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.embed.attend(x)  # tied head


def _loss(model, batch):
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def _batches(n):
    return [jax.random.randint(k, (4, 9), 0, 32) for k in jax.random.split(jax.random.key(7), n)]


def _nnx_losses(tx, data):
    """The plain loop's losses (``nnx.Optimizer`` on the device) and its model: the reference."""
    ref = _Net(nnx.Rngs(0))
    opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)

    @nnx.jit
    def train(model, opt, b):
        loss, g = nnx.value_and_grad(_loss)(model, b)
        opt.update(model, g)
        return loss

    return [float(train(ref, opt, b)) for b in data], ref


def _workers():
    return [p for p in multiprocessing.active_children() if p.name.startswith("near_storage_")]


def test_close_storage_takes_the_front_doors_step_and_a_closed_step_says_so(tmp_path):
    """docs/own_model.md: the disk tier's workers live "until
    chunkjax.storage.updater.close_storage(step)". Given the step chunkjax.offload returns, it
    raised AttributeError ('OffloadedStep' object has no attribute 'updaters'); and a step, sync
    or save after closing (close_storage(step.step)) ran the forward and then failed in the
    background with concurrent.futures' 'cannot schedule new futures after shutdown'. Right: the
    front door's step closes, its workers are gone, and each later use raises one StorageError
    line naming close_storage (a save: its CheckpointWriteError line holding it), with the step's
    state as before (a restore brings it back)."""
    from chunkjax.storage.files import StorageError
    from chunkjax.storage.updater import close_storage

    data = _batches(4)
    spec = AdamW(3e-3)
    want, ref = _nnx_losses(spec.optax(), data)
    model = _Net(nnx.Rngs(0))
    step = cj.offload(model, spec, _loss, data[0], device_budget="min", storage=[str(tmp_path / "disk")],
                      host_budget="189KiB")
    assert "storage" in step.schedule.update_locations, step.schedule.counts()
    got = [float(step(b)) for b in data[:2]]
    np.testing.assert_allclose(got, want[:2], rtol=2e-5)
    cj.save_checkpoint(tmp_path / "ck", 2, step)
    assert _workers()
    close_storage(step)
    assert not _workers()
    close_storage(step)  # twice: nothing more to stop
    from chunkjax.checkpoint.protocol import CheckpointWriteError
    for use, err in ((lambda: step(data[2]), StorageError), (lambda: step.sync(model), StorageError),
                     (lambda: cj.save_checkpoint(tmp_path / "ck2", 3, step), CheckpointWriteError)):
        with pytest.raises(err) as e:
            use()
        msg = str(e.value)
        assert "\n" not in msg and "close_storage" in msg and "restore_checkpoint" in msg, msg
    cj.restore_checkpoint(tmp_path / "ck", step)  # new workers; the run goes on as the uninterrupted one
    got += [float(step(b)) for b in data[2:]]
    np.testing.assert_allclose(got, want, rtol=2e-5)
    step.sync(model)
    for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(nnx.state(ref, nnx.Param)),
                         jax.tree.leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6, err_msg=str(p))
    close_storage(step)


def test_placement_figure_labels_do_not_overlap():
    """plots.plot_placement of a model with four placements (device-updated, frozen int leaf,
    streamed, host-updated chunks): the count bars' labels ("params pinned_host / update streamed"
    beside "params device / update none") were drawn over each other. Right: each label's box
    is clear of the others, and the bars are the schedule's counts."""
    import matplotlib
    matplotlib.use("Agg")
    from chunkjax import plots

    class _WithInt(_Net):
        def __init__(self, rngs):
            super().__init__(rngs)
            self.pos = nnx.Param(jnp.arange(8, dtype=jnp.int32))  # an int leaf: frozen, update "none"

        def __call__(self, tokens):
            return super().__call__(tokens + 0 * self.pos[: tokens.shape[1]])

    data = _batches(1)
    step = cj.offload(_WithInt(nnx.Rngs(0)), AdamW(1e-3), _loss, data[0], device_budget="min", min_chunks=12)
    counts = step.schedule.counts()
    assert len(counts) >= 4, counts
    fig = plots.plot_placement(step)
    ax2 = fig.axes[1]
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    r = canvas.get_renderer()
    labels = [t for t in ax2.get_xticklabels() + ax2.get_yticklabels() if "update" in t.get_text()]
    assert len(labels) == len(counts)
    boxes = [t.get_window_extent(r) for t in labels]
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            assert not boxes[i].overlaps(boxes[j]), (labels[i].get_text(), labels[j].get_text())
    assert [b.get_width() for b in ax2.patches] == list(counts.values())


class _WithComplex(_Net):
    def __init__(self, rngs):
        super().__init__(rngs)
        self.z = nnx.Param(jnp.full((32,), 0.5 + 0.5j, jnp.complex64))  # a learnable per-token gain |z|

    def __call__(self, tokens):
        return super().__call__(tokens) * jnp.abs(self.z[...])


def test_a_complex_parameter_is_refused_not_silently_frozen():
    """A complex64 nnx.Param that the loss reads: nnx.Optimizer trains it (JAX differentiates
    complex leaves), but chunkjax.offload and fit_step froze it without a word (the leaf is not
    floating), so the losses drifted from the plain loop's (1e-3 relative by step 10). Right: a
    complex leaf left trainable is refused in one line naming it; frozen on purpose (a trainable=
    filter without it) it trains the rest as nnx.Optimizer with the same filter does, and the
    complex leaf comes back bit for bit."""
    data = _batches(5)
    with pytest.raises(ValueError) as e:
        cj.offload(_WithComplex(nnx.Rngs(0)), optax.adam(1e-2), _loss, data[0], device_budget="min")
    msg = str(e.value)
    assert "\n" not in msg and "'z'" in msg and "complex64" in msg and "trainable" in msg, msg
    with pytest.raises(ValueError, match="'z' is complex64"):  # an explicit filter matching it
        cj.offload(_WithComplex(nnx.Rngs(0)), optax.adam(1e-2), _loss, data[0], device_budget="min",
                   trainable=nnx.Param)
    with pytest.raises(ValueError, match="is complex64"):  # the engine's own default (fit_step, stages)
        cj.layout.build_layout({"w": jnp.ones((4,), jnp.float32), "z": jnp.ones((4,), jnp.complex64)}, 8)
    real = nnx.All(nnx.Param, lambda path, v: not jnp.iscomplexobj(v[...]))
    ref = _WithComplex(nnx.Rngs(0))
    opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=real)

    @nnx.jit
    def train(model, opt, b):
        loss, g = nnx.value_and_grad(_loss, argnums=nnx.DiffState(0, real))(model, b)
        opt.update(model, g)
        return loss

    want = [float(train(ref, opt, b)) for b in data]
    model = _WithComplex(nnx.Rngs(0))
    z0 = np.asarray(model.z[...]).copy()
    step = cj.offload(model, optax.adam(1e-2), _loss, data[0], device_budget="min", trainable=real)
    got = [float(step(b)) for b in data]
    np.testing.assert_allclose(got, want, rtol=2e-5)
    step.sync(model)
    np.testing.assert_array_equal(np.asarray(model.z[...]), z0)
    np.testing.assert_allclose(np.asarray(model.embed.embedding[...]), np.asarray(ref.embed.embedding[...]),
                               rtol=1e-4, atol=1e-6)


def test_plan_cli_given_the_model_class_says_to_give_a_factory(tmp_path, monkeypatch):
    """`python -m experiments.plan --model mymodel:TiedMoE` (the model's class where the docs ask
    for a factory returning (model, loss_fn, batch)): the class was called with batch= and the
    CLI died with flax's TypeError traceback (exit 1). Right: one line saying what to give."""
    from experiments.plan import call_factory
    (tmp_path / "fresh26_user_model.py").write_text(
        "from flax import nnx\n\nclass Net(nnx.Module):\n    def __init__(self, d=4, *, rngs):\n"
        "        self.fc = nnx.Linear(d, d, rngs=rngs)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as e:
        call_factory("fresh26_user_model:Net", 8, 16)
    msg = str(e.value)
    assert "\n" not in msg and "is a class" in msg and "(model, loss_fn, batch)" in msg, msg


def test_front_door_takes_a_loss_scale_for_float16():
    """offload(..., compute_dtype=float16, loss_scaling=True) was accepted (fit_step's keyword),
    but step(batch) then always raised 'pass loss_scale exactly when the step was built with
    loss_scaling=True' and step() took no loss_scale: the option could not be used. Right:
    step(batch, loss_scale=s.scale) with a chunkjax.DynamicLossScale; an overflowing scale skips
    the step (no parameter changes) and halves the scale; a sane one trains like the float32
    nnx.Optimizer loop to float16 rounding."""
    data = _batches(6)
    want, _ = _nnx_losses(optax.adam(1e-2), data)
    model = _Net(nnx.Rngs(0))
    step = cj.offload(model, optax.adam(1e-2), _loss, data[0], device_budget="min", compute_dtype=jnp.float16,
                      loss_scaling=True)
    with pytest.raises(ValueError, match="pass loss_scale"):
        step(data[0])
    s = cj.DynamicLossScale(scale=2.0 ** 40, growth_interval=100)
    step.sync(model)
    before = [np.asarray(x).copy() for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    step(data[0], loss_scale=s.scale)  # float16 gradients overflow: skipped
    assert bool(step.metrics["skipped"])
    s = s.adjust(not bool(step.metrics["skipped"]))
    assert s.scale == 2.0 ** 39
    step.sync(model)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), before):
        np.testing.assert_array_equal(np.asarray(a), b)
    s = cj.DynamicLossScale(scale=2.0 ** 10, growth_interval=100)
    got = []
    for b in data:
        got.append(float(step(b, loss_scale=s.scale)))
        assert not bool(step.metrics["skipped"])
        s = s.adjust(True)
    np.testing.assert_allclose(got, want, rtol=3e-3)


def test_multisteps_wrapper_is_refused_with_what_to_pass():
    """optax.MultiSteps (what an nnx.Optimizer loop passes for gradient accumulation) is a wrapper,
    not a GradientTransformation: offload said "tx=MultiSteps: pass an optax transformation (e.g.
    optax.adamw(1e-3))" (the user did pass optax), the drop-in "tx must be an
    optax.GradientTransformation". Right: both name .gradient_transformation() (which runs chunk
    by chunk, as the trial checked against nnx.Optimizer) and micro_batches=."""
    data = _batches(1)
    tx = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2)
    with pytest.raises(TypeError) as e:
        cj.offload(_Net(nnx.Rngs(0)), tx, _loss, data[0], device_budget="min")
    with pytest.raises(TypeError) as e2:
        cj.NnxOptimizer(_Net(nnx.Rngs(0)), tx, device_budget="1MiB")
    for msg in (str(e.value), str(e2.value)):
        assert "\n" not in msg and "MultiSteps" in msg and ".gradient_transformation()" in msg, msg
    with pytest.raises(TypeError, match="tx=str: pass an optax transformation"):  # unchanged for others
        cj.offload(_Net(nnx.Rngs(0)), "adam", _loss, data[0], device_budget="min")


def test_a_scalar_batch_leaf_is_named():
    """A dict batch with a per-batch scalar (a loss weight, 1.0 or a () array) is refused, as
    documented (every leaf needs the rows first), but the line listed bare shapes
    ("batch leaves have leading sizes ['()', '(4, 9)']"), not which leaf. Right: it names the leaf
    and says how to pass a scalar."""
    data = _batches(1)

    def loss(model, batch):
        return _loss(model, batch["tokens"]) * jnp.mean(batch["w"])

    for w in (1.0, jnp.float32(1.0)):
        with pytest.raises(ValueError) as e:
            cj.offload(_Net(nnx.Rngs(0)), optax.adam(1e-3), loss, {"tokens": data[0], "w": w}, device_budget="min")
        msg = str(e.value)
        assert "\n" not in msg and "'w' ()" in msg and "'tokens' (4, 9)" in msg and "every row" in msg, msg
    step = cj.offload(_Net(nnx.Rngs(0)), optax.adam(1e-3), loss, {"tokens": data[0], "w": jnp.ones((4,))},
                      device_budget="min")
    assert np.isfinite(float(step({"tokens": data[0], "w": jnp.ones((4,))})))


def test_nnx_optimizer_names_itself_for_a_missing_or_misspelt_keyword():
    """NnxOptimizer(model, tx) without device_budget, or with device_budjet=, raised
    "ChunkedOptimizer.__init__() missing 1 required keyword-only argument" / "... got an unexpected
    keyword argument": a class the user never called. Right: the line names NnxOptimizer, and
    for the budget the spellings it takes; checked before the model is touched."""
    model = _Net(nnx.Rngs(0))
    with pytest.raises(TypeError) as e:
        cj.NnxOptimizer(model, optax.adam(1e-3))
    msg = str(e.value)
    assert msg.startswith("NnxOptimizer() missing") and "device_budget" in msg and "'min'" in msg, msg
    with pytest.raises(TypeError, match=r"^NnxOptimizer\(\) got an unexpected keyword argument 'device_budjet'"):
        cj.NnxOptimizer(model, optax.adam(1e-3), device_budjet="1MiB")
    opt = cj.NnxOptimizer(model, optax.adam(1e-3), device_budget="1MiB")
    assert opt.chunked.layout.n_chunks >= 1


def test_a_jitted_loss_is_refused_with_the_fix():
    """Users jit their loss: offload(model, tx, nnx.jit(loss_fn), ...) was refused with "run inside
    one jit/remat/scan equation: call each block at the top level of the loss", which does not
    say that the fix is to pass loss_fn itself. Right: the line says so; the plain loss trains."""
    data = _batches(1)
    with pytest.raises(ValueError) as e:
        cj.offload(_Net(nnx.Rngs(0)), optax.adam(1e-3), nnx.jit(_loss), data[0], device_budget="min")
    msg = str(e.value)
    assert "\n" not in msg and "not nnx.jit(loss_fn)" in msg, msg


def test_a_small_models_summary_gives_its_step_and_flops_in_units_it_reaches():
    """A tiny model's plan summary said "predicted step 0.0 ms" and "0.0 TFLOP per step". Right: the
    step in microseconds below 0.05 ms, the FLOPs in the largest unit they reach, each equal to the
    plan's own figure at that unit's rounding."""
    from chunkjax.errors import format_flops, format_step_seconds
    assert (format_step_seconds(1.5234), format_step_seconds(3.72e-5), format_step_seconds(0.0)) == (
        "1523.4 ms", "37.2 µs", "0.0 µs")
    assert (format_flops(304.3e12), format_flops(12.6e6), format_flops(2.4e9), format_flops(512)) == (
        "304.3 TFLOP", "12.6 MFLOP", "2.4 GFLOP", "512 FLOP")
    data = _batches(1)
    plan = cj.plan_offload(nnx.eval_shape(lambda: _Net(nnx.Rngs(0))), optax.adam(1e-3), _loss, data[0],
                           device_budget="min")
    text = plan.summary()
    step_s, flops = plan.predicted_time.step_s, plan.problem.flops_per_step
    assert f"predicted step {format_step_seconds(step_s)}" in text and "0.0 ms" not in text, text
    assert f"{format_flops(flops)} per step" in text and "0.0 TFLOP" not in text, text
    unit, k = format_flops(flops).split()[1], {"TFLOP": 1e12, "GFLOP": 1e9, "MFLOP": 1e6, "kFLOP": 1e3, "FLOP": 1}
    assert float(format_flops(flops).split()[0]) == pytest.approx(flops / k[unit], abs=0.05)


def test_a_budget_refusal_says_how_close_its_need_is():
    """The refusal said "below the 726656 bytes this step needs" while 726655 bytes trained: the
    figure is the least-budget search's upper end, within params/64 bytes of the need. Right: it
    says so ("found to within T bytes"), the figure plans, and a budget T below it does not."""
    import re
    ab = nnx.eval_shape(lambda: _Net(nnx.Rngs(0)))
    plan = lambda b: cj.plan_offload(ab, optax.adam(1e-3), _loss, _batches(1)[0], device_budget=b)  # noqa: E731
    with pytest.raises(cj.PlanError) as e:
        plan(1000)
    m = re.search(r"below the (\d+) bytes this step needs with every chunk offloaded \(found to within (\d+) bytes",
                  str(e.value))
    assert m, str(e.value)
    need, tol = int(m.group(1)), int(m.group(2))
    assert 1 <= tol <= need // 64 + 1
    assert plan(need).schedule is not None
    with pytest.raises(cj.PlanError):
        plan(need - tol)


def test_with_the_compiled_check_the_refusal_names_the_need_over_its_headroom():
    """On an accelerator the fit path holds the compiled step to HEADROOM of the budget, so the
    planner's need itself (what the refusal named) fails there; "min" is that need over the
    headroom. Right: with the compiled check (forced on here) the refusal names the need over
    HEADROOM (whether a step at that budget then passes the check is for a GPU to show: on the CPU
    the compiled sizes say nothing about a device); without it, the need itself."""
    import math
    import re

    from chunkjax.errors import format_bytes
    from chunkjax.fit import HEADROOM
    data = _batches(2)
    with pytest.raises(cj.PlanError) as e:
        cj.offload(_Net(nnx.Rngs(0)), optax.adam(1e-3), _loss, data[0], device_budget=1000, check_compiled=True)
    need = e.value.min_budget_bytes
    m = re.search(r"use device_budget >= (\S+) \(that need over the compiled check's 90% headroom", str(e.value))
    assert m and "\n" not in str(e.value), str(e.value)
    fix = int(math.ceil(need / HEADROOM))
    assert m.group(1) == format_bytes(fix, up=True) != format_bytes(need, up=True)
    with pytest.raises(cj.PlanError) as e:
        cj.offload(_Net(nnx.Rngs(0)), optax.adam(1e-3), _loss, data[0], device_budget=1000, check_compiled=False)
    assert str(e.value).endswith(f"use device_budget >= {format_bytes(e.value.min_budget_bytes, up=True)}"), str(e.value)
