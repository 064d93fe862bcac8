"""Device bytes live at each program launch (docs/device_live_bytes.md): what a step holds on the
device when each of its programs starts is what the plan and the compiled check count.

On the CPU memory kinds compile to nothing, but every array carries its kind: the
``jax.live_arrays()`` of kind ``device`` are the bytes a GPU would hold. GPT3_6B with 4
micro-batches in-program ran out of device memory on the H200 with its compiled check saying it
fit: the check counted beside each program only the device-updated chunks' state, not the 2.1e9 B
of resident compute params the backward programs do not take as arguments.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkjax as cj
from chunkjax import fit, predict, streamed
from chunkjax.host_update import AdamW
from chunkjax.memory import DEVICE
from chunkjax.step import ChunkedStep
from chunkjax.step_commit import PendingStep
from models import gpt

B, T, M = 2, 16, 4  # B rows per micro-batch, M micro-batches looped inside each program
#: Arrays below this size (bytes) are scalars and per-chunk squared norms (losses, norms, 1/scale):
#: counted apart and bounded as a whole (SMALL_TOTAL), not against the chunk accounting.
SMALL = 1024
SMALL_TOTAL = 16 * 1024


@pytest.fixture(scope="module")
def problem():
    cfg = gpt.get_config("micro", n_layers=2)
    rng = np.random.default_rng(23)
    params = jax.tree.map(lambda a: rng.normal(0.0, 0.02, a.shape).astype(np.float32), gpt.abstract_params(cfg))
    batches = [rng.integers(0, cfg.vocab_size, (M * B, T + 1)).astype(np.int32) for _ in range(2)]
    spec = AdamW(3e-3, weight_decay=0.1)  # no clipping: streamed updates may start early
    p = fit.prepare(gpt.gpt_stages(cfg), params, jax.ShapeDtypeStruct((M * B, T + 1), jnp.int32),
                    host_optimizer=spec, compute_dtype=jnp.float32, micro_batches=M, min_chunks=12,
                    host_budget=None, check_host=False)
    with pytest.raises(cj.PlanError) as e:
        fit.plan(p, 1000)
    budget = int(e.value.min_budget_bytes + 0.35 * p.cb.model_bytes(p.layout.n_chunks))
    return p, fit.plan(p, budget), params, batches


def _device_arrays(tree) -> dict[int, jax.Array]:
    return {id(a): a for a in jax.tree.leaves(tree)
            if isinstance(a, jax.Array) and not a.is_deleted() and a.sharding.memory_kind == DEVICE}


def _device_live(before: dict) -> list:
    """Device arrays alive now, less those alive before the step was built (``before``: id ->
    array, kept alive so their ids are not reused): other tests of the same process (an xdist
    worker runs many) may leave arrays alive that are not this step's."""
    return [a for a in jax.live_arrays()
            if not a.is_deleted() and a.sharding.memory_kind == DEVICE and before.get(id(a)) is not a]


def _live(before: dict, n_min: int = SMALL) -> int:
    return sum(a.nbytes for a in _device_live(before) if a.nbytes >= n_min)


def _measure(step, state, batches, monkeypatch, before: dict) -> tuple[list[dict], list[int]]:
    """Run ``batches`` through ``step``. Returns, at every program launch, the device arrays live
    in the process split into the program's arguments and the rest (bytes), and the live device
    bytes of the update phase: at each streamed chunk's update (its inputs and outputs on the
    device) and at each commit (before the device updates)."""
    rows, updates, real, real_update, real_commit = [], [], ChunkedStep.program, streamed.StepStream._update, \
        PendingStep.commit

    def program(self, batch, k):
        fn, args = real(self, batch, k)

        def launched(params, b, carry, acc):
            mine = _device_arrays((params, b, carry, acc))
            live = _device_live(before)
            beside = [a for a in live if id(a) not in mine]
            rows.append({"k": k, "args": sum(a.nbytes for a in mine.values() if a.nbytes >= SMALL),
                         "beside": sum(a.nbytes for a in beside if a.nbytes >= SMALL),
                         "small": sum(a.nbytes for a in live if a.nbytes < SMALL),
                         "what": sorted((a.shape, str(a.dtype)) for a in beside if a.nbytes >= SMALL)})
            return fn(params, b, carry, acc)
        return launched, args

    def update(self, c, *fetched):
        out = jax.block_until_ready(real_update(self, c, *fetched))
        updates.append(_live(before))
        return out

    def commit(self):
        updates.append(_live(before))
        return real_commit(self)

    monkeypatch.setattr(ChunkedStep, "program", program)
    monkeypatch.setattr(streamed.StepStream, "_update", update)
    monkeypatch.setattr(PendingStep, "commit", commit)
    for b in batches:
        state, m = step(state, b)
        assert np.isfinite(float(m["loss"]))
    step.wait(state)
    return rows, updates


@pytest.mark.parametrize("early", [False, True], ids=["streamed_after_backward", "streamed_early"])
def test_live_device_bytes_at_each_launch_are_accounted(problem, early, monkeypatch):
    """In-program micro-batches, device-updated, streamed and host chunks, several programs and a
    gradient window (streamed updates after the backward as planned, or early: their pipeline in
    flight during the backward), two steps (nothing of the first may be left at the second's
    launches): at every program launch the device bytes beside the program's arguments
    stay within what the compiled check counts beside it (the device-updated chunks' state plus
    ``beside_bytes``: resident params it does not read, waiting device gradients, the streamed
    pipeline), and everything live stays within the plan's device bytes at the program's first
    moment (early: plus the pipeline, planned without it); in the update phase everything live
    stays within the compiled check's and the plan's update phase."""
    p, s, params, batches = problem
    locs = set(s.update_locations)
    assert s.accumulation == "in_program" and {"device", "streamed", "host"} <= locs, (s.accumulation, locs)
    assert len(s.segments) > 2 and s.grad_window >= 2
    if early:
        s = dataclasses.replace(s, streamed_early=True)
    before = {id(a): a for a in jax.live_arrays()}  # not this step's (the fixture's params count: they stay)
    for a in jax.tree.leaves(params):
        before.pop(id(a), None)
    step = dataclasses.replace(fit.build_step(p, s), donate=True)  # the GPU's donation (ChunkedStep.donate)
    assert step.stream_spec.early == early and step.walk(batches[0]).micro_batches == M
    # the programs' own compiled sizes are XLA's (compiling them twice costs seconds): what is checked
    # here is what the compiled check counts beside them, and its update phase
    zero = {f: 0 for f in ("argument", "output", "temp", "alias", "peak_device_bytes")}
    monkeypatch.setattr(ChunkedStep, "compiled_memory_programs", lambda self, b: [zero] * len(self.program_bounds()))
    comp = fit.compiled_peak(p, step, s)
    progs, bounds = comp["programs"], step.program_bounds()
    rows, updates = _measure(step, step.init(params), batches, monkeypatch, before)
    assert [r["k"] for r in rows] == list(range(len(bounds))) * len(batches)
    plan = s.predicted.device_bytes_per_moment
    pipe = predict.streamed_pipeline_bytes(p.layout.chunk_size, p.cb) if early else 0  # the plan had none
    for r in rows:
        k, (t0, _) = r["k"], bounds[r["k"]]
        counted = comp["resident_state_bytes"] + progs[k].get("beside_bytes", 0)
        assert r["beside"] <= counted, (k, r["beside"], counted, r["what"])
        assert r["args"] + r["beside"] <= plan[t0] + pipe, (k, r, plan[t0])
        assert r["small"] <= SMALL_TOTAL, (k, r["small"])
    # the launch that holds most beside its program holds more than the device-updated state alone
    assert max(r["beside"] for r in rows) > comp["resident_state_bytes"]
    # the update phase (after the backward): the streamed pipeline runs while every device-updated
    # chunk's gradient waits for the commit (early: some streamed updates ran during the backward)
    assert len(updates) == len(batches) * (len(step.streamed_chunks) + 1)
    bound = s.predicted.peak_device_bytes + pipe if early else min(comp["update_phase_bytes"],
                                                                   s.predicted.peak_device_bytes)
    assert max(updates) <= bound, (updates, comp["update_phase_bytes"])
