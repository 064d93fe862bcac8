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


def test_stage_naming_a_missing_param_key_is_one_line(micro):
    stages, params, batch = micro
    bad = (dataclasses.replace(stages[0], param_keys=("wte", "nope")),) + tuple(stages[1:])
    with pytest.raises(ValueError, match=r"stage 'embed' names param key\(s\) \['nope'\] that the params do not have"):
        cj.fit_step(bad, params, batch, host_optimizer=AdamW(3e-4), device_budget="1GiB")
