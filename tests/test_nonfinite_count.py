"""``chunkjax.nonfinite.steps_taken`` on the optimizer states a step holds (no compile: eager optax
init/update on a tiny chunk). A clipped chain's state is ``(EmptyState, (ScaleByAdamState, ...))``:
the inner plain tuple's ``count`` is tuple.count, a method, which broke ``nonfinite="error"`` with a
host spec (``AdamW(max_grad_norm=...)``) as a TypeError instead of the one-line NonFiniteError."""
import types

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from chunkjax.nonfinite import NonFiniteError, raise_if_nonfinite, steps_taken


def _state(tx, n_updates):
    p = jnp.zeros((4,), jnp.float32)
    opt = tx.init(p)
    for _ in range(n_updates):
        _, opt = tx.update(jnp.ones_like(p), opt, p)
    return types.SimpleNamespace(master=[p], opt_state=[opt])


@pytest.mark.parametrize("tx", [optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
                                optax.adamw(1e-3), optax.adam(1e-3)], ids=["clip_adamw", "adamw", "adam"])
def test_steps_taken_reads_the_count_of_nested_chains(tx):
    assert steps_taken(_state(tx, 3)) == 3


def test_error_names_the_step_with_a_clipped_chain():
    state = _state(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), 1)
    step = types.SimpleNamespace(nonfinite="error")
    with pytest.raises(NonFiniteError, match="^step 2: the loss"):
        raise_if_nonfinite(step, state, {"loss": np.float32(np.nan), "grad_norm": np.float32(1.0)})


@pytest.mark.parametrize("loss,norm,said", [(np.nan, 1.0, "the loss is not finite"),
                                            (1.0, np.inf, "the gradient norm is not finite"),
                                            (np.nan, np.nan, "the loss and gradient norm are not finite")])
def test_error_is_one_sentence_whose_verb_agrees(loss, norm, said):
    """The NonFiniteError line: the verb agrees with what was non-finite ("is" for one, "are" for
    both: a user report of session 19), one line, what happened, then what to do."""
    state = _state(optax.adamw(1e-3), 4)
    step = types.SimpleNamespace(nonfinite="error")
    with pytest.raises(NonFiniteError) as e:
        raise_if_nonfinite(step, state, {"loss": np.float32(loss), "grad_norm": np.float32(norm)})
    msg = str(e.value)
    assert msg.startswith(f"step 5: {said} (loss ") and "\n" not in msg, msg
    assert ", so nothing was updated" in msg and msg.endswith("or pass nonfinite='skip' to skip such steps"), msg
