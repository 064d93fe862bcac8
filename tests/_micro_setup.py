"""The small GPT set-up the host-update tests share (overlap, cross-step, host bytes): a micro GPT
of ``n_layers`` blocks, ``steps`` batches of ``4 * rows`` rows of ``seq + 1`` tokens, its layout
in first-use order (at least 6 chunks) and its stage traces in float32."""
import jax
import jax.numpy as jnp
import numpy as np

import chunkjax as cj
from models import gpt


def micro_gpt_setup(n_layers: int, data_seed: int, init_seed: int, rows: int, seq: int, steps: int):
    """``(cfg, params, batches, stages, layout, traces)``; ``batches``: ``steps`` int32 arrays of
    shape ``(4 * rows, seq + 1)``; the layout is built on ``batches[0][:rows]``."""
    cfg = gpt.get_config("micro", n_layers=n_layers)
    rng = np.random.default_rng(data_seed)
    # one jitted program, not an eager dispatch (and compile) per random op: 1.2 s CPU against 2.9 s
    params = jax.jit(gpt.init_params, static_argnums=0)(cfg, jax.random.key(init_seed))
    batches = [jnp.asarray(rng.integers(0, cfg.vocab_size, (4 * rows, seq + 1)), jnp.int32) for _ in range(steps)]
    stages = gpt.gpt_stages(cfg)
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), params, batches[0][:rows])
    layout = cj.build_layout(params, None, order, min_chunks=6)
    traces = cj.trace_stages(stages, layout, jax.ShapeDtypeStruct((rows, seq + 1), jnp.int32), jnp.float32)
    return cfg, params, batches, stages, layout, traces
