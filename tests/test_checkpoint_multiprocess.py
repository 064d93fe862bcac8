"""Checkpoints of a ZeRO state sharded over 2 processes (``jax.distributed`` on localhost, 4
forced CPU devices each): saved with every process calling save_checkpoint, restored in place
(the continued losses equal the uninterrupted run bit for bit) and in this single process on its
own 8-device mesh (master params equal; the continued losses agree to float32 rounding)."""
import os
import sys

import jax
import numpy as np

import chunkjax as cj
from chunkjax import checkpoint as ck
from chunkjax.topology import build_zero_layout, data_mesh
from models import gpt

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import zero_multiprocess_worker as zmw  # noqa: E402


def test_two_process_zero_checkpoint_resumes_exactly_and_restores_on_one_process(zero3_two_process_run):
    seed, out, ckpt = zero3_two_process_run  # tests/checkpoint_multiprocess_worker.py, 2 processes
    got = np.load(out)
    assert int(got["n_devices"]) == 8 and int(got["n_processes"]) == 2
    np.testing.assert_array_equal(got["resumed"], got["losses"][2:])  # same processes: bit for bit
    meta = ck.read_meta(ckpt)
    assert meta["step"] == 2 and meta["saved_from"]["n_ranks"] == 8
    assert sorted(os.listdir(ckpt)) == ["step_00000002"]  # process 0 alone wrote; no temporaries

    # the 2-process checkpoint restored in this one process (8 local devices)
    cfg, params, batches, tx = zmw.draw(seed)
    layout = build_zero_layout(params, 8, cfg.vocab_size * cfg.d_model)
    step = zmw.make_step(cj, gpt.gpt_stages(cfg), layout, tx, data_mesh())
    state, extra = ck.restore_checkpoint(ckpt, step)
    for i, a in enumerate(jax.tree.leaves(step.master_params(state))):
        np.testing.assert_array_equal(a, got[f"p{i}"])
    losses = []
    for b in batches[extra["data_position"]:]:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, got["losses"][2:], rtol=2e-6)
