"""chunkjax.plots (issue 22, item 5): the figures of a micro GPT's plan carry the plan's data
(bar heights are the tide, the residency image is ``Schedule.residency()``, placement bytes sum to
the prediction), they take what the fit path gives, and they save to a path; and the main job's
loss.png draws each series once (experiments.report)."""
import dataclasses
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from matplotlib.colors import to_rgba

import chunkjax as cj
from chunkjax import fit, plots
from chunkjax.host_update import AdamW
from chunkjax.memory import DEVICE
from chunkjax.predict import device_bytes_by_kind
from chunkjax.schedule import UPDATE_LOCATIONS
from chunkjax.tide import memory_tide
from models import gpt

BUDGET = 4 * 2**20  # 4 MiB: micro GPT with some chunks resident, the rest fetched and updated on the host


@pytest.fixture(scope="module")
def fitted():
    cfg = gpt.get_config("micro")
    f = cj.fit_step(gpt.gpt_stages(cfg), gpt.abstract_params(cfg), jax.ShapeDtypeStruct((4, 33), jnp.int32),
                    host_optimizer=AdamW(3e-4), device_budget=BUDGET)
    s = f.report.schedule
    # the budget must exercise every mark: resident chunks, fetched chunks, evictions, host updates
    assert s.predicted.n_fetches > 0 and "device" in s.update_locations and "host" in s.update_locations
    return f


def _unit(ax):
    name = ax.get_ylabel().split()[-1]
    return {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "bytes": 1}[name]


def test_tide_bars_are_the_tide(fitted, tmp_path):
    tide = memory_tide(fitted.problem.traces, fitted.problem.layout.chunk_size)
    fig = plots.plot_tide(fitted, path=tmp_path / "tide.png")
    ax, ax2 = fig.axes
    k = _unit(ax)
    heights = [p.get_height() * k for p in ax.patches]
    assert heights == pytest.approx([m.non_model_bytes for m in tide.moments])
    assert [p.get_facecolor() for p in ax.patches] == [to_rgba(plots.PHASE_COLORS[m.phase]) for m in tide.moments]
    lines = {ln.get_label(): ln.get_ydata()[0] * k for ln in ax.lines}
    s = fitted.report.schedule
    assert lines["device budget"] == pytest.approx(BUDGET)
    assert lines["room beside resident model data"] == pytest.approx(BUDGET - s.predicted.device_model_bytes)
    assert [p.get_height() for p in ax2.patches] == [len(m.chunks) for m in tide.moments]
    assert [t.get_text() for t in ax2.get_xticklabels()] == [m.name for m in tide.moments]
    assert (tmp_path / "tide.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_device_bytes_stack_is_the_prediction(fitted):
    p, s = fitted.problem, fitted.report.schedule
    base = {k: fit.plan(p, BUDGET, policy=k, must_fit=False) for k in ("all_host", "zero_offload")}
    fig = plots.plot_device_bytes(fitted, {"chunkjax": s, **base})
    axes = [a for a in fig.axes if a.get_title()]
    assert [a.get_title().split(":")[0] for a in axes] == ["chunkjax", "all_host", "zero_offload"]
    tide = memory_tide(p.traces, p.layout.chunk_size)
    for ax, x in zip(axes, [s, *base.values()]):
        k = _unit(axes[0])
        layers = ax.collections
        assert len(layers) == 4
        parts = device_bytes_by_kind(x, p.traces, tide, p.cb_rank)
        # each layer's upper edge is a step at the running sum of the parts over each moment:
        # a vertex at that height on each side of the moment's centre, within half a moment
        tops = np.cumsum(np.array(list(parts.values()), float), axis=0)
        for layer, want in zip(layers, tops):
            v = layer.get_paths()[0].vertices
            for t, w in enumerate(want):
                xs = v[np.isclose(v[:, 1] * k, w, rtol=1e-6) & (np.abs(v[:, 0] - t) <= 0.5), 0]
                assert (xs <= t).any() and (xs >= t).any(), (ax.get_title(), t)
        assert tops[-1].tolist() == pytest.approx(list(x.predicted.device_bytes_per_moment))
        lines = {ln.get_label(): ln for ln in ax.lines}
        assert lines["budget"].get_ydata()[0] * k == pytest.approx(BUDGET)
        rel = lines["copies released as Schedule.evict says"].get_ydata() * k
        assert rel == pytest.approx(plots.released_bytes(p, x))
        # released copies never count more than the prediction
        assert (np.array(plots.released_bytes(p, x)) <= np.array(x.predicted.device_bytes_per_moment)).all()


def test_schedule_image_is_the_residency(fitted):
    s = fitted.report.schedule
    fig = plots.plot_schedule(fitted)
    ax, strip = fig.axes[:2]
    img = ax.images[0].get_array()
    res = np.array(s.residency())
    placed = np.array([k == DEVICE for k in s.param_kinds])
    assert img.shape == (s.n_chunks, len(s.moments))
    assert (img == np.where(res, np.where(placed[:, None], 2, 1), 0)).all()
    marks = {ln.get_label(): sorted(zip(ln.get_xdata(), ln.get_ydata())) for ln in ax.lines}
    dx = plots.FETCH_EVICT_DX
    assert marks["fetch"] == sorted((t - dx, c) for t, cs in enumerate(s.fetch) for c in cs)
    assert marks["evict"] == sorted((t + dx, c) for t, cs in enumerate(s.evict) for c in cs)
    tide = memory_tide(fitted.problem.traces, fitted.problem.layout.chunk_size)
    assert marks["read"] == sorted((t, c) for t, cs in enumerate(tide.accesses) for c in cs)
    cuts = [ln.get_xdata()[0] for ln in ax.lines if ln.get_linestyle() == ":"]
    assert cuts == [c - 0.5 for c in s.segments[1:]]
    assert strip.images[0].get_array()[:, 0].tolist() == [UPDATE_LOCATIONS.index(u) for u in s.update_locations]
    # a bare schedule plots too (no reads to mark)
    bare = plots.plot_schedule(s)
    assert "read" not in {ln.get_label() for ln in bare.axes[0].lines}


def test_placement_bytes_sum_to_the_prediction(fitted):
    s, p = fitted.report.schedule, fitted.problem
    pb = plots.placement_bytes(p, s)
    assert sum(pb["device"].values()) == s.predicted.device_model_bytes
    assert sum(pb["pinned_host"].values()) + sum(pb["host (pageable)"].values()) == s.predicted.host_model_bytes
    n_host = s.update_locations.count("host")
    assert pb["host (pageable)"]["master params + optimizer state"] == n_host * p.cb.state
    fig = plots.plot_placement(fitted)
    ax, ax2 = fig.axes[:2]
    k = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "bytes": 1}[ax.get_xlabel()]
    widths = np.array([b.get_width() for b in ax.patches]).reshape(len(plots.PLACEMENT_LISTS), -1) * k
    want = np.array([[pb[kind][lst] for kind in plots.PLACEMENT_KINDS] for lst in plots.PLACEMENT_LISTS])
    assert widths == pytest.approx(want)
    assert [b.get_width() for b in ax2.patches] == list(s.counts().values())


def test_budget_sweep_and_step_time(fitted):
    p = fitted.problem
    budgets = [3 * 2**20, BUDGET, 6 * 2**20, 12 * 2**20]
    sweep = {b: fit.plan(p, b) for b in budgets}
    base = {k: fit.plan(p, BUDGET, policy=k, must_fit=False) for k in ("all_host", "zero_offload")}
    fig = plots.plot_budget_sweep(sweep, base, budget_bytes=BUDGET)
    ax, ax2 = fig.axes
    line = {ln.get_label(): ln for ln in ax.lines}["chunkjax"]
    assert list(line.get_ydata()) == pytest.approx([sweep[b].predicted.time.step_s for b in budgets])
    moved = {ln.get_label(): ln for ln in ax2.lines}["chunkjax h2d + d2h"]
    mk = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "bytes": 1}[ax2.get_ylabel().split()[0]]
    assert list(moved.get_ydata() * mk) == pytest.approx(
        [sweep[b].predicted.h2d_bytes_per_step + sweep[b].predicted.d2h_bytes_per_step for b in budgets])
    zo = [ln for ln in ax.lines if ln.get_label().startswith("zero_offload")][0]
    assert set(zo.get_ydata()) == {base["zero_offload"].predicted.time.step_s}

    s = fitted.report.schedule
    fig = plots.plot_step_time(fitted, measured_s=[1e-4, 3e-4, 2e-4])
    bars = fig.axes[0].patches
    # forward + backward + device update, then the host tail and the streamed updates at once
    assert max(b.get_x() + b.get_width() for b in bars[:5]) == pytest.approx(s.predicted.time.step_s)
    t = s.predicted.time
    assert [b.get_width() for b in bars[:5]] == pytest.approx(
        [t.forward_s, t.backward_s, t.device_update_s, t.host_update_exposed_s, t.streamed_update_s])
    assert bars[5].get_width() == pytest.approx(2e-4)
    assert t.cross_step  # the fit path's default; the joined step's bars end at its own step time
    joined = fit.plan(dataclasses.replace(p, cross_step=False), BUDGET)
    tj, jbars = joined.predicted.time, plots.plot_step_time(joined).axes[0].patches
    assert not tj.cross_step and tj.step_s > t.step_s
    assert max(b.get_x() + b.get_width() for b in jbars[:5]) == pytest.approx(tj.step_s)
    assert [b.get_width() for b in jbars[:5]] == pytest.approx(
        [tj.forward_s, tj.backward_s, tj.device_update_s, tj.host_update_exposed_s, tj.streamed_update_s])


def test_save_figures_and_inputs(fitted, tmp_path):
    out = plots.save_figures(fitted, tmp_path / "figs")
    assert sorted(out) == ["device_bytes", "placement", "schedule", "tide"]
    for path in out.values():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a problem with a schedule gives the same figure data as the Fitted
    a = plots.plot_schedule(fitted).axes[0].images[0].get_array()
    b = plots.plot_schedule(fitted.problem, schedule=fitted.report.schedule).axes[0].images[0].get_array()
    assert (a == b).all()
    with pytest.raises(ValueError, match="needs the fit problem"):
        plots.plot_tide(fitted.report.schedule)
    with pytest.raises(ValueError, match="needs a schedule"):
        plots.plot_schedule(fitted.problem)
    with pytest.raises(TypeError, match="cannot plot a dict"):
        plots.plot_tide({})
    # a bare Schedule: the plots that need the stage traces say which plots take one, in one line
    for plot in (plots.plot_tide, plots.plot_placement):
        with pytest.raises(ValueError, match=r"a Schedule alone holds no stage traces: plot it with plot_device_bytes") as e:
            plot(fitted.report.schedule)
        assert "\n" not in str(e.value)
    assert plots.plot_device_bytes(fitted.report.schedule).axes
    # plot_budget_sweep of one plan (not a {budget: Schedule} mapping): one TypeError line
    for bad in (fitted, fitted.report.schedule, {}, {"8MiB": fitted.report.schedule}):
        with pytest.raises(TypeError, match=r"plot_budget_sweep takes \{budget bytes: Schedule\}") as e:
            plots.plot_budget_sweep(bad)
        assert "\n" not in str(e.value)


def test_zero_rank_placement_is_one_ranks():
    """Under ZeRO the figures use one rank's chunk bytes: the placement sums to the per-rank
    prediction (planned on abstract shapes for 2 ranks by the planner CLI's inputs)."""
    from experiments import plan

    inp = plan.prepare("micro", 8, 64, n_ranks=2)
    problem = plan.plan_problem(inp, None, 1, 3)
    s, _ = plan.plan_schedules(inp, 64 * 2**20)
    pb = plots.placement_bytes(problem, s)
    assert sum(pb["device"].values()) == s.predicted.device_model_bytes
    assert sum(pb["pinned_host"].values()) + sum(pb["host (pageable)"].values()) == s.predicted.host_model_bytes
    fig = plots.plot_device_bytes(problem, s)
    assert len(fig.axes[0].collections) == 4


def test_import_does_not_load_matplotlib():
    code = "import sys, chunkjax.plots; assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env={"JAX_PLATFORMS": "cpu", "PYTHONPATH": "."},
                   cwd=pathlib.Path(__file__).resolve().parents[1])


def test_frozen_chunks_of_a_lora_model():
    """chunkjax.offload's step of a LoRA model (base frozen): the plots take the step, frozen
    chunks (update location none) carry params only, and the placement still sums to the
    prediction."""
    import optax
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, d, rngs):
            self.fc = nnx.LoRALinear(d, d, lora_rank=4, rngs=rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.fc(x))

    class LM(nnx.Module):
        def __init__(self, rngs, vocab=64, d=32):
            self.emb, self.out = nnx.Embed(vocab, d, rngs=rngs), nnx.Linear(d, vocab, rngs=rngs)
            self.blocks = nnx.List([Block(d, rngs) for _ in range(3)])

        def __call__(self, ids):
            x = self.emb(ids)
            for b in self.blocks:
                x = b(x)
            return self.out(x)

    def loss_fn(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch[:, :-1]), batch[:, 1:]).mean()

    step = cj.offload(LM(nnx.Rngs(0)), optax.adamw(1e-3), loss_fn, jnp.zeros((4, 17), jnp.int32),
                      trainable=nnx.LoRAParam, device_budget=160_000)
    s, cb = step.schedule, step.problem.cb_rank
    frozen = [c for c, u in enumerate(s.update_locations) if u == "none"]
    assert frozen and len(frozen) < s.n_chunks
    pb = plots.placement_bytes(step.problem, s)
    assert sum(pb["device"].values()) == s.predicted.device_model_bytes
    assert sum(pb["pinned_host"].values()) + sum(pb["host (pageable)"].values()) == s.predicted.host_model_bytes
    trained_off = sum(u not in ("device", "none") for u in s.update_locations)
    assert pb["pinned_host"]["gradients"] == trained_off * cb.grad
    fig = plots.plot_schedule(step)
    strip = fig.axes[1].images[0].get_array()[:, 0]
    assert [c for c, v in enumerate(strip) if UPDATE_LOCATIONS[int(v)] == "none"] == frozen
    assert "frozen (no update)" in [t.get_text() for t in fig.legends[0].get_texts()]


def test_figures_of_a_plan_with_storage_chunks(fitted, tmp_path):
    """A plan with disk chunks (the host budget below what the host-updated chunks need) plots and
    saves every figure; the disk row holds the storage chunks' master params and state and the
    host rows still sum to the prediction (the workers' staging buffers included)."""
    cfg = gpt.get_config("micro")
    f = cj.fit_step(gpt.gpt_stages(cfg), gpt.abstract_params(cfg), jax.ShapeDtypeStruct((4, 33), jnp.int32),
                    host_optimizer=AdamW(3e-4), device_budget=BUDGET,
                    host_budget=fitted.report.schedule.predicted.host_bytes // 2, storage=[str(tmp_path / "disk")])
    s, p = f.report.schedule, f.problem
    n_disk = s.update_locations.count("storage")
    assert n_disk > 0
    pb = plots.placement_bytes(p, s)
    assert pb["disk"]["master params + optimizer state"] == n_disk * p.cb.state
    assert sum(pb["pinned_host"].values()) + sum(pb["host (pageable)"].values()) == s.predicted.host_model_bytes
    assert pb["host (pageable)"]["disk staging"] == s.predicted.storage_host_bytes > 0
    out = plots.save_figures(f, tmp_path / "figs")
    assert sorted(out) == ["device_bytes", "placement", "schedule", "tide"]
    for path in out.values():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plots.plot_step_time(f).axes


@pytest.mark.parametrize("steps,labels", [
    (3, ["train (per step)", "validation"]),  # ux20: a short run drew the per-step loss twice
    (79, ["train (per step)", "validation"]),
    (400, ["train (per step)", "train (10-step mean)", "validation"])])
def test_loss_plot_draws_each_series_once(tmp_path, monkeypatch, steps, labels):
    """experiments.report.plot_losses (the main job's loss.png): one line per series; the running
    mean only where it averages more than one step. The figure's lines are counted as saved."""
    import json

    import matplotlib.pyplot as plt

    from experiments.report import plot_losses
    rng = np.random.default_rng(steps)
    loss = 10 - np.cumsum(rng.uniform(0, 0.02, steps))
    recs = [{"step": 0, "tokens": 0, "val_loss": 10.5}]
    recs += [{"step": i, "tokens": 1024 * i, "loss": float(loss[i - 1]), "skipped": False}
             | ({"val_loss": float(loss[i - 1]) + 0.1} if i % 2 == 0 or i == steps else {}) for i in range(1, steps + 1)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in recs))
    closed = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (closed.append(fig), close(fig)))
    plot_losses(tmp_path / "loss.png", metrics, title="t")
    assert (tmp_path / "loss.png").stat().st_size > 0 and len(closed) == 1
    lines = closed[0].axes[0].get_lines()
    assert [ln.get_label() for ln in lines] == labels
    np.testing.assert_array_equal(lines[0].get_ydata(), loss)
    n_val = 1 + steps // 2 + steps % 2
    assert len(lines[-1].get_ydata()) == n_val and lines[-1].get_ydata()[0] == 10.5
    if len(labels) == 3:
        np.testing.assert_allclose(lines[1].get_ydata(), np.convolve(loss, np.ones(10) / 10, mode="valid"), rtol=1e-12)
