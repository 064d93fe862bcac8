"""The fit path refuses setups that would train wrong numbers silently (found by a new user's
trial, issue 20 / issue 22 item 4): one line each, before anything is traced or allocated."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import chunkjax as cj
from chunkjax.host_update import AdamW
from models import gpt


@pytest.fixture(scope="module")
def micro():
    cfg = gpt.get_config("micro", n_layers=2)
    params = gpt.init_params(cfg, jax.random.key(int(np.random.default_rng().integers(1 << 30))))
    batch = jax.ShapeDtypeStruct((4, 17), jnp.int32)
    return gpt.gpt_stages(cfg), params, batch


def test_non_elementwise_transformation_is_refused(micro):
    stages, params, batch = micro
    for tx in (optax.lamb(1e-2), optax.lars(1e-2)):
        with pytest.raises(ValueError, match="not elementwise"):
            cj.fit_step(stages, params, batch, tx=tx, device_budget="1GiB")


def test_tx_and_host_optimizer_together_are_refused(micro):
    stages, params, batch = micro
    with pytest.raises(ValueError, match="not both"):
        cj.fit_step(stages, params, batch, tx=optax.sgd(0.5), host_optimizer=AdamW(3e-4), device_budget="1GiB")
    with pytest.raises(ValueError, match="not neither"):
        cj.fit_step(stages, params, batch, device_budget="1GiB")


def test_integer_compute_dtype_is_refused(micro):
    stages, params, batch = micro
    with pytest.raises(ValueError, match="compute_dtype=int32: use a floating dtype"):
        cj.fit_step(stages, params, batch, host_optimizer=AdamW(3e-4), compute_dtype=jnp.int32, device_budget="1GiB")


def test_last_stage_must_return_a_scalar(micro):
    stages, params, batch = micro
    head = stages[-1]
    per_row = dataclasses.replace(head, apply=lambda p, x, b: jnp.full((b.shape[0],), head.apply(p, x, b)))
    with pytest.raises(ValueError, match=r"the last stage \('head'\) returns shape \(4,\): it must return the scalar loss"):
        cj.fit_step(stages[:-1] + (per_row,), params, batch, host_optimizer=AdamW(3e-4), device_budget="1GiB")


def test_last_stage_must_return_a_float_loss(micro):
    """An integer loss (jax.grad refuses it) is refused in one line, not trained with zero gradients."""
    stages, params, batch = micro
    head = stages[-1]
    counted = dataclasses.replace(head, apply=lambda p, x, b: jnp.round(head.apply(p, x, b) * 100).astype(jnp.int32))
    with pytest.raises(TypeError, match=r"the last stage \('head'\) returns a loss of dtype int32: return a floating-point") as e:
        cj.fit_step(stages[:-1] + (counted,), params, batch, host_optimizer=AdamW(3e-4), device_budget="1GiB")
    assert "\n" not in str(e.value)


def test_stage_naming_a_missing_param_key_is_one_line(micro):
    stages, params, batch = micro
    bad = (dataclasses.replace(stages[0], param_keys=("wte", "nope")),) + tuple(stages[1:])
    with pytest.raises(ValueError, match=r"stage 'embed' names param key\(s\) \['nope'\] that the params do not have"):
        cj.fit_step(bad, params, batch, host_optimizer=AdamW(3e-4), device_budget="1GiB")


# ---- issue 22 item 4: the same checks on every path (the fit path, the drop-in optimizers) ----

NON_ELEMENTWISE = {
    "lamb": lambda: optax.lamb(1e-2),
    "lars": lambda: optax.lars(1e-2),
    "adamw-masked-by-name": lambda: optax.adamw(1e-3, mask=lambda p: {k: k != "b" for k in p}),
}


@pytest.mark.parametrize("name", sorted(NON_ELEMENTWISE))
def test_non_elementwise_is_refused_in_one_line_on_every_path(micro, name):
    from flax import nnx
    stages, params, batch = micro
    paths = {
        "fit_step": lambda tx: cj.fit_step(stages, params, batch, tx=tx, device_budget="1GiB"),
        "ChunkedOptimizer": lambda tx: cj.ChunkedOptimizer({"a": jnp.zeros((3, 3)), "b": jnp.zeros((4,))}, tx,
                                                           device_budget="1GiB"),
        "NnxOptimizer": lambda tx: cj.NnxOptimizer(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), tx, device_budget="1GiB"),
    }
    for path, make in paths.items():
        with pytest.raises(ValueError, match="not elementwise") as e:
            make(NON_ELEMENTWISE[name]())
        assert "\n" not in str(e.value), (path, str(e.value))


def test_weight_decay_mask_is_refused_even_unchecked(micro):
    """Session 19 (a fresh user): ``optax.adamw(..., mask=no_decay_on_1d)`` with ``check_tx=False``
    was accepted and its mask, called on a chunk (a flat array), decayed no element at all: wrong
    numbers. Every path refuses a mask in one line saying what to do, with or without the probe;
    an unmasked adamw still passes unchecked."""
    from flax import nnx
    stages, params, batch = micro
    tx = lambda: optax.adamw(1e-3, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    paths = {
        "fit_step": lambda tx, **kw: cj.fit_step(stages, params, batch, tx=tx, device_budget="1GiB", **kw),
        "ChunkedOptimizer": lambda tx, **kw: cj.ChunkedOptimizer({"a": jnp.zeros((3, 3)), "b": jnp.zeros((4,))}, tx,
                                                                 device_budget="1GiB", **kw),
        "NnxOptimizer": lambda tx, **kw: cj.NnxOptimizer(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), tx,
                                                         device_budget="1GiB", **kw),
    }
    for path, make in paths.items():
        for kw in ({}, {"check_tx": False}):
            with pytest.raises(ValueError) as e:
                make(tx(), **kw)
            msg = str(e.value)
            assert "\n" not in msg and "masks leaves" in msg and "drop mask=" in msg and "weight_decay=0" in msg, (path, msg)
    paths["ChunkedOptimizer"](optax.adamw(1e-3, weight_decay=0.1), check_tx=False)


def test_budgets_as_ints_or_strings_through_one_parser(micro):
    """fit_step and the drop-in take the same budget forms and refuse the same bad ones with the
    same message (chunkjax.fit.resolve_budget)."""
    stages, params, batch = micro
    small = {"w": jnp.zeros((64,))}
    for budget in (2**30, "1GiB", "1e9", "1073741824"):
        assert cj.ChunkedOptimizer(small, optax.sgd(0.1), device_budget=budget).layout.n_chunks == 1
    for budget in (2**30, "1GiB"):
        cj.fit_step(stages, params, batch, host_optimizer=AdamW(3e-4), device_budget=budget)
    for bad in ("lots", "0", 0, "-1GiB"):
        msgs = []
        for make in (lambda b: cj.ChunkedOptimizer(small, optax.sgd(0.1), device_budget=b),
                     lambda b: cj.fit_step(stages, params, batch, host_optimizer=AdamW(3e-4), device_budget=b)):
            with pytest.raises(ValueError) as e:
                make(bad)
            msgs.append(str(e.value))
        assert msgs[0] == msgs[1] and "\n" not in msgs[0], msgs
    with pytest.raises(ValueError, match="'auto' is not supported by the drop-in"):
        cj.ChunkedOptimizer(small, optax.sgd(0.1), device_budget="auto")


def test_budget_spellings_are_the_same_everywhere(micro):
    """chunkjax.budget.parse_budget: a whole float is bytes for the drop-in and fit_step alike;
    'min' gives the drop-in the least budget its chunks need (a byte less fails); 'auto' for the
    drop-in and 'min' for fit_step are refused in one line naming the spellings each takes."""
    stages, params, batch = micro
    small = {"w": jnp.zeros((5000,))}
    assert cj.ChunkedOptimizer(small, optax.adam(0.1), device_budget=3.5e6).device_budget == 3_500_000
    cj.fit_step(stages, params, batch, host_optimizer=AdamW(3e-4), device_budget=float(2**30))
    opt = cj.ChunkedOptimizer(small, optax.adam(0.1), device_budget="MIN", chunk_size=1000)
    need = opt.device_budget
    assert 0 < need <= opt.working_bytes + opt.device_state_bytes + 2 * 1000 * 12
    with pytest.raises(cj.PlanError):
        cj.ChunkedOptimizer(small, optax.adam(0.1), device_budget=need - 1, chunk_size=1000)
    with pytest.raises(ValueError, match=r"'auto' is not supported by the drop-in optimizer .*or 'min'$") as e:
        cj.ChunkedOptimizer(small, optax.adam(0.1), device_budget="auto")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"'min' is not supported by the fit path .*or 'auto'$"):
        cj.fit_step(stages, params, batch, host_optimizer=AdamW(3e-4), device_budget="min")
    with pytest.raises(TypeError, match=r"device_budget must be a whole number of bytes, got 1.5"):
        cj.ChunkedOptimizer(small, optax.adam(0.1), device_budget=1.5)


def test_drop_in_name_errors_are_one_line_naming_the_key():
    params = {"w": jnp.zeros((3,)), "blk": {"x": jnp.zeros((2,))}}
    with pytest.raises(ValueError, match=r"^order names leaf 'nope' that the params do not have: use leaf paths"):
        cj.ChunkedOptimizer(params, optax.sgd(0.1), device_budget="1GiB", order=["blk/x", "nope"])
    opt = cj.ChunkedOptimizer(params, optax.sgd(0.1), device_budget="1GiB")
    for grads, want in (({"w": jnp.zeros((3,))}, "leaf 'blk/x' is missing"),
                        ({"w": jnp.zeros((3,)), "blk": {"y": jnp.zeros((2,))}}, "leaf 'blk/x' is missing (got 'blk/y' instead)")):
        with pytest.raises(ValueError) as e:
            opt.update(grads)
        assert str(e.value) == f"grads do not have the params' structure: {want}"
    with pytest.raises(ValueError, match=r"host_chunks=2 needs tx given as a host kernel spec"):
        cj.ChunkedOptimizer(params, optax.sgd(0.1), device_budget="1GiB", host_chunks=2)
    with pytest.raises(ValueError, match=r"host_chunks=5 but 0 chunk\(s\) have their state in pinned host memory"):
        cj.ChunkedOptimizer({f"w{i}": jnp.zeros((8,)) for i in range(4)}, AdamW(1e-3), chunk_size=8,
                            device_budget="1GiB", host_chunks=5)


def test_library_errors_name_no_command_line_flags():
    """Flag advice belongs to the tools (experiments/flags.py turns argument names into flags):
    no string in chunkjax/ names a ``--flag`` (XLA's own flags aside)."""
    import pathlib
    import re
    root = pathlib.Path(cj.__file__).parent
    hits = [f"{p.relative_to(root)}:{i}: {line.strip()}" for p in sorted(root.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"[\"' ]--[a-z][a-z-]+", line) and "--xla" not in line and not line.strip().startswith("#")]
    assert not hits, hits
    from experiments.flags import with_flags
    assert with_flags("use device_budget >= 2.000GiB or a larger host_budget; chunk_size=128") == \
        "use --device-budget >= 2.000GiB or a larger --host-budget; chunk_size=128"
    assert with_flags("host_budget >= 3.000GiB, or storage directories (the disk tier)") == \
        "--host-budget >= 3.000GiB, or --storage DIR (the disk tier)"


def test_summary_names_the_host_working_set_for_what_it_holds(micro):
    """The plan's line said "gradient working set" for ``predicted.host_working_bytes``, which also
    holds every streamed chunk's new params and state (written back beside the old until the step
    returns: ``chunkjax.predict``), so a fresh user's 7.1 MiB "gradients" were 4.3 MiB of streamed
    write-back (fresh19). The line now names both, with the same number."""
    from chunkjax.errors import format_bytes, format_moved_bytes
    from chunkjax.fit_report import describe
    stages, params, batch = micro
    step, report, problem = cj.fit_step(stages, params, batch, host_optimizer=AdamW(3e-4), device_budget="auto")
    line, p = describe(report, problem), report.schedule.predicted
    assert "gradient working set" not in line, line
    assert (f"working set {format_bytes(p.host_working_bytes)}: host gradients in flight and streamed "
            "write-back") in line, line
    # bytes held in binary units (as budgets are given), bytes moved per step in decimal ones (ux20)
    assert (f"per step h2d {format_moved_bytes(p.h2d_bytes_per_step)}, d2h {format_moved_bytes(p.d2h_bytes_per_step)}; "
            f"host {format_bytes(p.host_bytes)} (") in line and " MiB" not in line, line
