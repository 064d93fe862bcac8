"""Placement proven structurally on the CPU: export the chunked step for the GPU.

On the CPU, moves between memory kinds compile to nothing, so the test exports the jitted
forward/backward for CUDA (``jax.export(..., platforms=("cuda",))``) and reads the StableHLO:
off-device chunks must be pinned_host arguments that are only ever read through an
``optimization_barrier`` (the tie that stops XLA hoisting the fetch to the program start) and
then moved to the device, in exactly the planned order; gradients of host-updated chunks must
leave as pinned_host results.
"""
import re

import jax
import jax.numpy as jnp
import optax
import pytest

import chunkjax as cj
from chunkjax.memory import sharding
from chunkjax.plan import fetch_events
from models import gpt


def _export(placement_fn, prefetch):
    cfg = gpt.get_config("micro")
    stages = gpt.gpt_stages(cfg)
    ap = gpt.abstract_params(cfg)
    ab = jax.ShapeDtypeStruct((2, 33), jnp.int32)
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), ap, ab)
    layout = cj.build_layout(ap, cfg.vocab_size * cfg.d_model, order)
    placement = placement_fn(layout.n_chunks)
    step = cj.make_chunked_step(stages, layout, placement, optax.adamw(1e-3), jnp.bfloat16, prefetch=prefetch)
    args = (tuple(jax.ShapeDtypeStruct((layout.chunk_size,), jnp.bfloat16, sharding=sharding(k))
                  for k in placement.param_kinds),
            jax.ShapeDtypeStruct(ab.shape, ab.dtype, sharding=sharding(cj.DEVICE)))
    exp = jax.export.export(step.jit_fwd_bwd, platforms=("cuda",))(*args)
    return step, exp.mlir_module()


def _main_signature(txt):
    return next(l for l in txt.splitlines() if "func.func public @main" in l)


def _main_body(txt, sig):
    """Lines of @main only (private helper functions have their own %arg numbering)."""
    lines = txt.split(sig, 1)[1].splitlines()
    end = next(i for i, l in enumerate(lines) if l.startswith("  }"))
    return "\n".join(lines[:end])


def _planned_fetch_sequence(step):
    n = len(step.stages)
    b = jax.ShapeDtypeStruct((2, 33), jnp.int32)
    f_ev, b_ev = fetch_events(step.traces(b), step.placement, step.prefetch)  # the fixed rule's fetches per stage
    fwd = [f_ev[s] for s in range(n)]
    bwd = [b_ev[s] for s in range(n - 2, -1, -1)]
    return [c for pos in fwd for c in pos] + [c for pos in bwd for c in pos]


PLACEMENTS = {
    "mixed": lambda n: cj.Placement(tuple(cj.DEVICE if c in (1, 2) else cj.PINNED_HOST for c in range(n)),
                                    tuple(cj.DEVICE if c % 3 == 0 else cj.PINNED_HOST for c in range(n))),
    "all_host": lambda n: cj.Placement.uniform(n, cj.PINNED_HOST, cj.PINNED_HOST),
}


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_export_places_and_orders_fetches(name, prefetch):
    step, txt = _export(PLACEMENTS[name], prefetch)
    pl = step.placement
    sig = _main_signature(txt)
    # arguments: memory kind per chunk as placed
    arg_kinds = re.findall(r'%arg(\d+): tensor<[^>]*> \{mhlo.memory_kind = "(\w+)"', sig)
    kinds = {int(i): k for i, k in arg_kinds}
    for c in range(pl.n_chunks):
        assert kinds[c] == pl.param_kinds[c], (c, kinds[c])
    # results: gradient chunks leave in the kind the update needs
    res = re.findall(r'jax.result_info = "result\[1\]\[(\d+)\]", mhlo.memory_kind = "(\w+)"', sig)
    assert len(res) == pl.n_chunks
    for c, k in res:
        assert k == pl.grad_kind(int(c))

    body = _main_body(txt, sig)
    host_args = [c for c in range(pl.n_chunks) if pl.param_kinds[c] == cj.PINNED_HOST]
    # every use of a host argument is an optimization_barrier operand (never direct compute)
    for c in host_args:
        for line in body.splitlines():
            if re.search(rf"%arg{c}\b", line):
                assert "stablehlo.optimization_barrier" in line, line.strip()[:160]
    # the barriered host arguments, in program order, are exactly the planned fetch sequence
    fetched = [int(m) for m in re.findall(r"stablehlo.optimization_barrier %[\w#]+, %arg(\d+)", body)]
    assert fetched == _planned_fetch_sequence(step)
    assert len(fetched) > len(host_args)  # chunks are re-fetched in backward, not kept resident
    # each barriered chunk is then moved to the device
    n_to_device = len(re.findall(r'_xla_buffer_placement = "device"', body))
    assert n_to_device >= len(fetched)
    # gradient chunks of host-updated chunks are moved to pinned_host inside the program
    n_to_host = len(re.findall(r'_xla_buffer_placement = "pinned_host"', body))
    assert n_to_host >= sum(pl.grad_kind(c) == cj.PINNED_HOST for c in range(pl.n_chunks))


def test_prefetch_distance_moves_fetches_earlier():
    """With a larger prefetch distance, fetches are tied to earlier activations: the number of
    distinct anchors stays the same or shrinks, and the first fetches are issued together."""
    _, t1 = _export(PLACEMENTS["all_host"], 1)
    _, t2 = _export(PLACEMENTS["all_host"], 2)
    a1 = re.findall(r"stablehlo.optimization_barrier (%[\w#]+), %arg\d+", t1)
    a2 = re.findall(r"stablehlo.optimization_barrier (%[\w#]+), %arg\d+", t2)
    # the fetches issued at the very first anchor (the batch) grow with the distance
    assert a2.count(a2[0]) > a1.count(a1[0])


def test_compiled_memory_reports_sizes():
    """The compiler's memory analysis the GPU plan check uses: all fields present, sizes sane."""
    step, _ = _export(PLACEMENTS["mixed"], 1)
    mem = step.compiled_memory(jax.ShapeDtypeStruct((2, 33), jnp.int32))
    assert mem["peak_device_bytes"] == mem["argument"] + mem["output"] + mem["temp"] - mem["alias"]
    chunk_bytes = step.layout.chunk_size * 2  # bf16 compute chunks
    assert mem["argument"] >= step.placement.n_chunks * chunk_bytes // 2 and mem["temp"] > 0
