"""The fit path's compiled check (``check_compiled=True``, on by default on accelerators) compiles
the programs the step then runs: every program of a step built by the fit path is lowered and
compiled once, by the check, and the step's first call compiles none again (it once compiled
each twice: the check lowered pinned_host chunks as device-memory avals, so jit traced and
compiled every program again at the first step, doubling the GPU set-up time)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compiles import count_compiles

from chunkjax import fit, topology
from chunkjax.host_update import AdamW
from models import gpt

def _programs(names) -> list[int]:
    """The step's program numbers among lowered module names (``jit(chunkjax_program_<k>)``)."""
    return sorted(int(m.group(1)) for n in names if (m := re.search(r"chunkjax_program_(\d+)", n)))


@pytest.mark.parametrize("setup", ["one_device", "zero3_loss_scaling"])
def test_fit_path_step_compiles_each_program_once(setup):
    """One device with chunks in pinned_host (params fetched, host and streamed updates), and a
    ZeRO-3 mesh of 2 forced devices with fp16 loss scaling (the scale carried into the first
    program) and 2 micro-batches: the check lowers each program once, the step's first two
    calls lower none of them, and the step trains (finite loss, state changed)."""
    cfg = gpt.get_config("micro", n_layers=2)
    rows = 4
    batch = jax.ShapeDtypeStruct((rows, 17), jnp.int32)
    kw = dict(host_optimizer=AdamW(1e-3), compute_dtype=jnp.float32)
    if setup == "zero3_loss_scaling":
        kw = dict(kw, compute_dtype=jnp.float16, loss_scaling=True, micro_batches=2,
                  mesh=topology.data_mesh(jax.devices()[:2]), zero_stage=3)
    problem = fit.prepare(gpt.gpt_stages(cfg), gpt.abstract_params(cfg), batch, **kw)
    with count_compiles() as fitting:
        step, rep, _ = fit.fit_problem(problem, "auto", check_compiled=True)
    n_programs = len(step.program_bounds())
    assert rep.compiled is not None and len(rep.compiled["programs"]) == n_programs
    if setup == "one_device":  # the case of the double compile: param chunks in pinned_host
        assert "pinned_host" in step.placement.param_kinds, step.placement.param_kinds
    lowered = _programs(fitting["lowered"])
    assert lowered == list(range(n_programs)), lowered

    rng = np.random.default_rng()
    # one jitted program, not an eager dispatch (and compile) per random op (tests/_micro_setup.py)
    state = step.init(jax.jit(gpt.init_params, static_argnums=0)(cfg, jax.random.key(int(rng.integers(1 << 30)))))
    before = np.asarray(state.params[0]).copy()
    scale = {"loss_scale": 2.0 ** 8} if setup == "zero3_loss_scaling" else {}
    for i in range(2):
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (rows, 17)), jnp.int32)
        with count_compiles() as n:
            state, m = step(state, tokens, **scale)
            step.wait(state)
        assert not _programs(n["lowered"]), f"call {i} compiled the step's programs again: {n['lowered']}"
        assert np.isfinite(float(m["loss"]))
    assert not np.array_equal(np.asarray(state.params[0]), before)


def test_kept_executable_refusing_its_arguments_falls_back_to_the_jitted_program():
    """kept_programs.runnable: an executable given arguments it was not compiled for (here another
    dtype; on a GPU another sharding) refuses them before running; the program then runs jitted
    (same result as plain jit) and the executable is dropped from the step's cache."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from chunkjax import kept_programs

    fn = jax.jit(lambda x: x * 2 + 1)
    exe = fn.lower(jax.ShapeDtypeStruct((4,), jnp.float32)).compile()
    cache, batch = {}, {"x": np.zeros((2, 3), np.int32)}
    run = kept_programs.runnable(cache, fn, batch, 0, exe)
    assert len(cache) == 1
    x = np.random.default_rng(0).standard_normal(4).astype(np.float32)
    np.testing.assert_array_equal(run(x), x * 2 + 1)  # the kept executable
    xi = np.arange(4, dtype=np.int32)
    np.testing.assert_array_equal(run(xi), np.asarray(fn(xi)))  # refused: the jitted program
    assert cache == {}
    assert kept_programs.runnable(cache, fn, batch, 0) is fn  # nothing kept: the jitted program


def test_compiled_margin_plans_the_first_plan_below_the_headroom(monkeypatch):
    """``compiled_margin``: the first plan leaves that many bytes below the headroom (less a chunk),
    so a setting whose compiler overshoot was measured once (s19b2: GPT3_18B's in-program programs
    compiled 5.7e9 over their accounting) is planned where the re-plan would land, with one compile
    of its programs instead of two. The compiled check still holds the whole budget's headroom."""
    cfg = gpt.get_config("micro", n_layers=2)
    problem = fit.prepare(gpt.gpt_stages(cfg), gpt.abstract_params(cfg), jax.ShapeDtypeStruct((4, 17), jnp.int32),
                          host_optimizer=AdamW(1e-3), compute_dtype=jnp.float32)
    full = fit.plan(problem, 1 << 40).predicted.peak_device_bytes
    budget, chunk = int(full), problem.cb_rank.params  # a budget the all-device plan fills: the headroom offloads
    peaks = []

    def compiled(problem_, step, sched):  # the accounting exactly (no compile): the check passes at once
        peaks.append(int(sched.predicted.peak_device_bytes))
        return {"peak_bytes": peaks[-1]}

    monkeypatch.setattr(fit, "compiled_peak", compiled)
    hist = {}
    for margin in (0, 3 * chunk):
        rep = fit.fit_problem(problem, budget, check_compiled=True, compiled_margin=margin).report
        assert len(rep.plans) == 1 and rep.fits and rep.budget_bytes == budget
        hist[margin] = rep.plans[0]
        assert hist[margin]["effective_budget_bytes"] == int(fit.HEADROOM * budget) - chunk - margin
        assert peaks[-1] <= hist[margin]["effective_budget_bytes"]
    assert hist[3 * chunk]["predicted_peak_bytes"] < hist[0]["predicted_peak_bytes"]  # the margin moved chunks off
