"""Planner CLI (issue 3, items 4-5): JSON keys, baselines planned over the same tide, the
infeasible-budget errors, the GPU-recorded tide, and the recorded GPT3_6B schedule reproduced;
ZeRO over N ranks (issue 10: --ranks, --zero-stage) against plan_schedule(ranks=N) called directly."""
import json
import pathlib
import re

import pytest

from chunkjax.plan import plan_schedule
from chunkjax.predict import device_bytes_by_kind
from chunkjax.schedule import HOST_UPDATE, Schedule
from experiments import plan

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORDED = ROOT / "experiments" / "results" / "bench_s3c_gpt3_6b_24g.json"
KEYS = ["predicted_peak_device_bytes", "device_budget_bytes", "h2d_bytes_per_step", "d2h_bytes_per_step",
        "predicted_step_s", "n_chunks", "chunk_size", "placement_counts", "baselines"]
MICRO = ["--model", "micro", "--batch", "2", "--seq", "64"]
_CACHE: dict = {}
_trace = plan.trace_inputs
_trace_user = plan.trace_user_model


@pytest.fixture(autouse=True)
def cached_trace(monkeypatch):
    """Trace each (model, batch, seq) once for the whole module (tracing is the slow part): the
    named models and the ``module:factory`` user models (tests/…/my_user_model.py, the same
    source in every test; a factory that raises is not cached, so every bad spec still raises)."""
    def cached(trace):
        def traced(model, batch, seq, **kw):
            key = (model, batch, seq, kw.get("chunk_size"), kw.get("min_chunks", 8), kw.get("n_ranks", 1),
                   str(kw.get("compute_dtype")), kw.get("micro_batches", 1), str(kw.get("storage")),
                   kw.get("host_budget"))
            if key not in _CACHE:
                _CACHE[key] = trace(model, batch, seq, **kw)
            return _CACHE[key]
        return traced

    monkeypatch.setattr(plan, "trace_inputs", cached(_trace))
    monkeypatch.setattr(plan, "trace_user_model", cached(_trace_user))


def test_plan_json_and_baselines(capsys):
    assert plan.main(MICRO + ["--device-budget", "8MiB", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    for k in KEYS:
        assert k in r, k
    assert set(r["baselines"]) == {"all_host", "zero_offload"}
    for b in r["baselines"].values():
        for k in KEYS[:-1] + ["feasible"]:
            assert k in b, k
    assert r["tide_source"] == "estimated on cpu"
    # the chunkjax plan fits and never moves more bytes than streaming everything
    ah, zo = r["baselines"]["all_host"], r["baselines"]["zero_offload"]
    assert r["feasible"] and r["predicted_peak_device_bytes"] <= r["device_budget_bytes"]
    assert r["h2d_bytes_per_step"] <= ah["h2d_bytes_per_step"]
    # zero-offload: every chunk up once per step, every gradient down once
    assert zo["h2d_bytes_per_step"] == zo["d2h_bytes_per_step"] > 0 and zo["n_fetches"] == r["n_chunks"]
    # all_host: every chunk offloaded, updated on the host
    assert ah["placement_counts"] == {"params_pinned_host/update_host": r["n_chunks"]}


def test_baselines_are_fixed_schedules():
    """all_host fetches every chunk at every moment that reads it (no holding), so it moves
    at least as many bytes as the Belady plan with nothing resident; zero_offload fetches every
    chunk at the step's start and holds it to its last read, its host update exposed."""
    inp = plan.prepare("micro", 2, 64)
    tide, cb, n = inp.tide, inp.cb, inp.layout.n_chunks
    big = 10**12
    ah = plan_schedule(inp.layout, inp.traces, cb, big, policy="all_host", flops_per_step=inp.flops_per_step)
    assert [set(f) for f in ah.fetch] == [set(m.chunks) for m in tide.moments]
    assert ah.predicted.n_fetches == sum(len(set(m.chunks)) for m in tide.moments)
    assert ah.update_locations == (HOST_UPDATE,) * n
    res = ah.residency()
    for t, m in enumerate(tide.moments):  # on the device exactly while read
        assert {c for c in range(n) if res[c][t]} == set(m.chunks)
        assert ah.predicted.device_bytes_per_moment[t] >= m.non_model_bytes + len(set(m.chunks)) * cb.params
    belady = plan_schedule(inp.layout, inp.traces, cb, big, flops_per_step=inp.flops_per_step, resident=[])
    assert ah.predicted.h2d_bytes_per_step >= belady.predicted.h2d_bytes_per_step
    zo = plan_schedule(inp.layout, inp.traces, cb, big, policy="zero_offload", flops_per_step=inp.flops_per_step)
    read = {c for m in tide.moments for c in m.chunks}
    assert zo.predicted.n_fetches == len(read) and zo.predicted.h2d_bytes_per_step == len(read) * cb.params
    assert zo.prefetch >= len(tide.moments) - 1  # every fetch issued at the first moment
    res = zo.residency()
    for c in read:  # held from its first read to its last (issued at the step's start)
        ts = [t for t, m in enumerate(tide.moments) if c in m.chunks]
        assert res[c] == [False] * ts[0] + [True] * (ts[-1] + 1 - ts[0]) + [False] * (len(tide.moments) - ts[-1] - 1)
    assert zo.predicted.peak_device_bytes >= len(read) * cb.params
    assert zo.predicted.time.host_update_exposed_s == pytest.approx(zo.predicted.time.host_update_s)
    assert zo.segments == (0,)
    for s in (ah, zo, belady):  # the split by kind adds up and has no negative part
        kinds = device_bytes_by_kind(s, inp.traces, tide, cb)
        assert all(min(v) >= 0 for v in kinds.values())
        assert [sum(x) for x in zip(*kinds.values())] == list(s.predicted.device_bytes_per_moment)
    assert device_bytes_by_kind(zo, inp.traces, tide, cb)["resident model data"] == [0] * len(tide.moments)


def test_plan_infeasible_exits_2_and_names_budgets_that_work(capsys):
    assert plan.main(MICRO + ["--device-budget", "100KiB", "--json"]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and "use --device-budget >=" in err[0]
    need = json.loads(cap.out)["min_device_budget_bytes"]
    assert plan.main(MICRO + ["--device-budget", str(need), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["host_bytes"] > 1000
    # the device budget fits, the host budget does not: the message names the host budget needed
    assert plan.main(MICRO + ["--device-budget", str(need), "--host-budget", "1000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "use --host-budget >=" in err[0], err
    host = re.search(r"--host-budget >= (\d[\d.]*(?:[KMGT]iB|B))", err[0]).group(1)
    assert plan.main(MICRO + ["--device-budget", str(need), "--host-budget", host]) == 0


def test_tide_from_recorded_run(tmp_path, capsys):
    """Recorded stage temporaries replace the traced ones when model/batch/seq match (blocks
    take h_0's); otherwise the plan says it is estimated on the CPU."""
    rec = {"model": "micro", "batch": 2, "seq": 64,
           "systems": {"chunkjax": {"model": "micro", "batch": 2, "seq": 64, "extra": {
               "stage_temp_bytes": {"embed": 1000, "h_0": 2000, "head": 3000},
               "rates": {"matmul_flops_per_s": 1e12, "host_update_s_per_param": 1e-9}}}}}
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(rec))
    inp = plan.prepare("micro", 2, 64, tide_from=str(path))
    assert inp.tide_source.startswith("recorded on gpu")
    assert {t.name: t.temp_bytes for t in inp.traces} == {
        "embed": 1000, **{f"h_{i}": 2000 for i in range(4)}, "head": 3000}
    assert inp.rates.matmul_flops_per_s == 1e12 and inp.rates.host_update_s_per_param == 1e-9
    rec["systems"]["chunkjax"]["batch"] = 3
    path.write_text(json.dumps(rec))
    assert plan.main(MICRO + ["--device-budget", "64MiB", "--tide-from", str(path)]) == 0
    cap = capsys.readouterr()
    assert "estimated on cpu" in cap.out and "recorded for micro at batch 3x64" in cap.err


def test_plan_readable_summary():
    out = plan.summary(plan.plan_report("micro", 8 * 2**20, None, 2, 64))
    for word in ("chunkjax", "all_host", "zero_offload", "where the time goes", "exposed host update",
                 "estimated on cpu", "programs"):
        assert word in out, word


def test_a_rare_plans_step_with_clipping_is_retimed_with_the_default_bound(capsys):
    """The CLI plans an unclipped AdamW (its table's step); ``if_clipped`` gives the ``"rare"`` plan's
    step if the host kernel clipped: retimed (chunkjax.program_cut.retime) with the step's default
    backup pool (chunkjax.speculate.DEFAULT_BACKUP_BYTES, 12 bytes a speculated AdamW parameter in
    whole chunks, each copied), never below the table's; the summary says which is which. None for
    a "fires" plan; with micro-batches it is not retimed (the planner's figure, labelled)."""
    import dataclasses

    from chunkjax.program_cut import retime
    from chunkjax.speculate import DEFAULT_BACKUP_BYTES
    inp = plan.prepare("micro", 2, 64)
    sched, _ = plan.plan_schedules(inp, 3 * 2**20)
    problem = plan.plan_problem(inp)
    cs, n_host = inp.layout.chunk_size, sum(u == HOST_UPDATE for u in sched.update_locations)
    assert n_host >= 2 and problem.clip_expect == "rare" and problem.host_optimizer.max_grad_norm is None
    c = plan.if_clipped(problem, sched)
    n = DEFAULT_BACKUP_BYTES // (12 * cs) * cs
    want = retime(sched, inp.cb, chunk_size=cs, traces=inp.traces, tide=inp.tide, rates=inp.problem.rates,
                  flops_per_step=inp.problem.flops_per_step, cross_step=problem.cross_step,
                  speculation_params=n, backup_bytes_per_param=12.0).time.step_s
    assert c["retimed"] and c["host_chunks"] == n_host and c["predicted_step_s"] == want
    assert want >= sched.predicted.time.step_s * (1 - 1e-12)
    assert c["speculation_bound"] == {"bytes": DEFAULT_BACKUP_BYTES, "params": n, "rollback": "backup",
                                      "chunks": n // cs, "backup_bytes_per_param": 12.0}
    assert plan.main(MICRO + ["--device-budget", "3MiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["if_clipped"] == c
    assert plan.main(MICRO + ["--device-budget", "3MiB"]) == 0
    line = (f"speculation within the default backup pool (16.00 GiB: {n_host} of {n_host} host chunks), predicted "
            f"step {want * 1e6:.3f} us; the table's step is the planner's, every host chunk speculating (as without "
            "clipping)")
    out = capsys.readouterr().out  # the planned AdamW does not clip: the line says so (fresh25), not "with clipping"
    assert f"if clipping were configured (--max-grad-norm, rare): {line}" in out and "with clipping (rare)" not in out
    assert plan.main(MICRO + ["--device-budget", "3MiB", "--max-grad-norm", "1", "--clip-expect", "rare", "--json"]) == 0
    clipped = json.loads(capsys.readouterr().out)["if_clipped"]
    assert plan.main(MICRO + ["--device-budget", "3MiB", "--max-grad-norm", "1", "--clip-expect", "rare"]) == 0
    out = capsys.readouterr().out
    assert (f"with clipping (rare): speculation within the default backup pool" in out
            and "if clipping were configured" not in out and clipped["host_chunks"] >= 2)
    assert plan.if_clipped(dataclasses.replace(problem, clip_expect="fires"), sched) is None
    micro = plan.if_clipped(dataclasses.replace(problem, micro_batches=2), sched)
    assert not micro["retimed"] and micro["predicted_step_s"] == sched.predicted.time.step_s
    text = plan.summary(dict(plan.plan_report("micro", 3 * 2**20, None, 2, 64, inputs=inp), if_clipped=micro))
    assert "if clipping were configured (--max-grad-norm, rare): the step above, if every host chunk speculates" in text


def _assert_recorded(got: dict, recorded: dict, inp, cb, cut_chosen: bool = False):
    """``got`` (a schedule's ``to_dict``) equals a recorded one in every recorded field; fields
    added after the recording keep their defaults (no master-fetch chunks, streamed updates after
    the backward). The recorded step time is the cost model's before it timed the gradient window
    (issue 23): the schedule re-timed with an unbounded window (``window=0``) and the recorded cut
    gives it exactly. With ``cut_chosen`` (one device) the planner chose the program cut on the
    window's timeline: the recorded cut is the doubling one, and the chosen cut is predicted no
    slower than it (the other decisions are the recorded ones)."""
    from chunkjax.program_cut import auto_segments, retime
    sched = Schedule.from_dict(got)
    kw = dict(chunk_size=inp.layout.chunk_size, traces=inp.traces, tide=inp.tide, rates=inp.problem.rates,
              flops_per_step=inp.problem.flops_per_step)
    skip = ("predicted", "segments") if cut_chosen else ("predicted",)
    assert {k: got[k] for k in recorded if k not in skip} == {k: v for k, v in recorded.items() if k not in skip}
    old = retime(sched, cb, segments=recorded["segments"], window=0, **kw).time.to_dict()
    pred = dict(got["predicted"], time={k: old[k] for k in recorded["predicted"]["time"]})
    assert {k: pred[k] for k in recorded["predicted"]} == recorded["predicted"]
    assert got.get("master_fetch", []) == [] and got.get("streamed_early", False) is False
    if cut_chosen:
        assert tuple(recorded["segments"]) == auto_segments(len(inp.tide.moments), len(inp.traces))
        at_recorded = retime(sched, cb, segments=recorded["segments"], **kw).time.step_s
        assert sched.predicted.time.step_s <= at_recorded


def test_recorded_gpt3_6b_schedule_reproduced():
    """The one big config: on the CPU, with the GPU run's stage temporaries and rates, the planner
    gives exactly the schedule that run executed (at the budget it planned for after its compile
    check), and its predictions."""
    rec = json.loads(RECORDED.read_text())["systems"]["chunkjax"]["extra"]
    # the run's chunk size (>= every leaf, as the search chose before leaves could span chunks)
    inp = plan.prepare("GPT3_6B", 32, 1024, chunk_size=rec["chunk_size"], tide_from=str(RECORDED))
    assert inp.tide_source.startswith("recorded on gpu")
    sched, base = plan.plan_schedules(inp, rec["effective_budget_bytes"], split=False)  # recorded before the update split
    got = sched.to_dict()
    _assert_recorded(got, rec["schedule"], inp, inp.cb, cut_chosen=True)
    assert Schedule.from_dict(got) == sched
    old = Schedule.from_dict(rec["schedule"])  # the recorded file still reads: the same decisions
    assert (old.param_kinds, old.update_locations, old.fetch, old.evict) == (sched.param_kinds, sched.update_locations,
                                                                              sched.fetch, sched.evict)
    kinds = device_bytes_by_kind(sched, inp.traces, inp.tide, inp.cb)
    assert all(min(v) >= 0 for v in kinds.values())
    assert [sum(x) for x in zip(*kinds.values())] == list(sched.predicted.device_bytes_per_moment)
    assert base["all_host"].predicted.h2d_bytes_per_step > sched.predicted.h2d_bytes_per_step


# ---- ZeRO over N ranks (--ranks, --zero-stage; issue 10) -------------------------------------

ZMICRO = ["--model", "micro", "--batch", "8", "--seq", "64"]  # global batch 8: 4 rows per rank at 2, 1 at 8


def _reference_zero(n_ranks: int, zero_stage: int = 3, batch: int = 8, seq: int = 64):
    """(layout, traces, cb, flops of one rank) built here, as experiments/bench_chunkjax.py builds a
    ZeRO run's inputs (not through experiments.plan)."""
    import jax
    import jax.numpy as jnp

    import chunkjax as cj
    from chunkjax.host_update import AdamW
    from chunkjax.optim import state_bytes_per_chunk
    from chunkjax.topology import build_zero_layout
    from models import gpt

    cfg = gpt.get_config("micro")
    stages, ap = gpt.gpt_stages(cfg), gpt.abstract_params(cfg)
    ab = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), ap, ab)
    cs = cj.build_layout(ap, None, order, min_chunks=8).chunk_size
    layout = build_zero_layout(ap, n_ranks, cs, order)
    traces = cj.trace_stages(stages, layout, jax.ShapeDtypeStruct((batch // n_ranks, seq + 1), jnp.int32),
                             jnp.bfloat16)
    cb = cj.chunk_bytes(layout, jnp.bfloat16, state_bytes_per_chunk(AdamW(1e-4, weight_decay=1e-4).optax(),
                                                                    layout.chunk_size))
    return layout, traces, cb, cfg.flops_per_token(seq) * batch * seq // n_ranks


def _min_budget(plan_fn) -> int:
    from chunkjax import PlanError
    with pytest.raises(PlanError) as e:
        plan_fn(1000)
    return e.value.min_budget_bytes


@pytest.mark.parametrize("n_ranks", [2, 8])
def test_zero_plan_matches_plan_schedule(n_ranks, capsys):
    """--ranks N: per-rank host, H2D and D2H bytes, peak and step are those of
    plan_schedule(ranks=N, zero_stage=3) on the same inputs built independently; node figures are
    N x a rank's."""
    from chunkjax.cost import Rates

    layout, traces, cb, flops = _reference_zero(n_ranks)

    def ref(budget):
        return plan_schedule(layout, traces, cb, budget, ranks=n_ranks, zero_stage=3, flops_per_step=flops,
                             host_update=True, prefetch=1, rates=Rates())

    budget = _min_budget(ref)  # the smallest per-GPU budget: chunks offloaded, bytes move
    s = ref(budget)
    want = s.predicted
    assert want.host_model_bytes > 0 and want.h2d_bytes_per_step > 0
    # one rank's bytes: a fetch moves the rank's shard (stage 3), an offloaded chunk's gradient
    # leaves as its shard, the host holds the shard of params, state and gradient
    share = lambda b: -(-b // n_ranks)  # noqa: E731
    off = sum(u != "device" for u in s.update_locations)
    assert want.h2d_bytes_per_step == want.n_fetches * share(cb.params)
    assert want.d2h_bytes_per_step == off * share(cb.grad)
    assert want.host_model_bytes == off * (share(cb.params) + share(cb.master + cb.opt) + share(cb.grad))
    assert plan.main(ZMICRO + ["--ranks", str(n_ranks), "--device-budget", str(budget), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["n_ranks"], r["zero_stage"], r["batch"], r["batch_per_rank"]) == (n_ranks, 3, 8, 8 // n_ranks)
    assert r["chunk_size"] == layout.chunk_size and r["chunk_size"] % n_ranks == 0
    pr, node = r["per_rank"], r["node"]
    assert pr["host_bytes"] == r["host_bytes"] == want.host_model_bytes
    assert pr["h2d_bytes_per_step"] == want.h2d_bytes_per_step
    assert pr["d2h_bytes_per_step"] == want.d2h_bytes_per_step
    assert pr["peak_device_bytes"] == want.peak_device_bytes <= budget
    assert pr["predicted_step_s"] == pytest.approx(want.time.step_s)
    assert node["host_bytes"] == n_ranks * want.host_model_bytes
    assert node["h2d_bytes_per_step"] == n_ranks * want.h2d_bytes_per_step
    assert node["tokens_per_s"] == pytest.approx(8 * 64 / want.time.step_s)
    assert r["baselines"] == {} and "collective" in r["predicted_time_note"]
    # collectives accounted (not timed): stage 3 gathers each fetched chunk, reduce-scatters each gradient
    part = (n_ranks - 1) * layout.chunk_size * 2 // n_ranks
    cm = r["collective_bytes_per_step_per_rank"]
    assert cm["reduce_scatter"] == part * len({c for t in traces for c in t.chunks})
    if all(k.startswith("params_pinned_host") for k in r["placement_counts"]):
        assert cm["all_gather"] == part * want.n_fetches
    assert cm["total"] == cm["all_gather"] + cm["reduce_scatter"] and cm["all_reduce"] == 0


def test_zero3_rank_model_bytes_about_1_over_n(capsys):
    """At the smallest budget (everything offloaded), a ZeRO-3 rank holds about 1/N of the
    model data --ranks 1 holds on the host (chunk rounding apart)."""
    def at_min(extra):
        assert plan.main(ZMICRO + extra + ["--device-budget", "1KiB", "--json"]) == 2
        need = json.loads(capsys.readouterr().out)["min_device_budget_bytes"]
        assert plan.main(ZMICRO + extra + ["--device-budget", str(need), "--json"]) == 0
        r = json.loads(capsys.readouterr().out)
        offloaded = {k: v for k, v in r["placement_counts"].items() if k.startswith("params_pinned_host/update_")}
        assert sum(offloaded.values()) == r["n_chunks"] and "params_pinned_host/update_device" not in offloaded
        return r

    one = at_min([])
    for n in (2, 8):
        r = at_min(["--ranks", str(n)])
        # model data, not the one-device working set (its streamed chunks' written-back state)
        assert r["host_model_bytes"] / one["host_model_bytes"] == pytest.approx(1 / n, rel=0.15)
        assert r["node"]["host_bytes"] == pytest.approx(one["host_model_bytes"], rel=0.15)


def test_ranks_1_output_unchanged(capsys):
    """--ranks 1 is the single-device plan: same JSON, same text, no ZeRO keys."""
    outs = []
    for extra in ([], ["--ranks", "1"]):
        assert plan.main(MICRO + ["--device-budget", "8MiB", "--json"] + extra) == 0
        r = json.loads(capsys.readouterr().out)
        r.pop("plan_s")
        outs.append(r)
    assert outs[0] == outs[1]
    assert not {"n_ranks", "zero_stage", "per_rank", "node"} & set(outs[0])
    assert set(outs[0]["baselines"]) == set(plan.BASELINES)
    texts = []
    for extra in ([], ["--ranks", "1"]):
        assert plan.main(MICRO + ["--device-budget", "8MiB"] + extra) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and "zero_offload" in texts[0]


@pytest.mark.parametrize("extra, words", [
    (["--batch", "6", "--ranks", "4"], ["--batch 6", "multiple of 4", "--batch 8"]),
    (["--ranks", "0"], ["--ranks must be >= 1", "--ranks 1"]),
    (["--ranks", "-2"], ["--ranks must be >= 1"]),
    (["--ranks", "2", "--zero-stage", "4"], ["--zero-stage must be 1, 2 or 3", "use 3"]),
    (["--ranks", "2", "--zero-stage", "0"], ["--zero-stage must be 1, 2 or 3"]),
    (["--zero-stage", "2"], ["--zero-stage 2 needs --ranks N > 1"]),
    (["--ranks", "1", "--zero-stage", "3"], ["needs --ranks N > 1"]),
])
def test_bad_ranks_input_exits_2_with_one_line(extra, words, capsys):
    assert plan.main(["--model", "micro", "--seq", "64", "--device-budget", "8MiB"] + extra + ["--json"]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    for w in words:
        assert w in err[0], (w, err[0])
    assert cap.out == ""


def test_zero_host_budget_is_the_nodes(capsys):
    """--host-budget with --ranks is the node's: too small exits 2 with one line naming the node
    budget needed, and that budget plans; each rank keeps within its 1/N share."""
    args = ZMICRO + ["--ranks", "2", "--device-budget", "1KiB", "--json"]
    assert plan.main(args) == 2
    need = json.loads(capsys.readouterr().out)["min_device_budget_bytes"]
    args = ZMICRO + ["--ranks", "2", "--device-budget", str(need)]
    assert plan.main(args + ["--host-budget", "1000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "use --host-budget >=" in err[0] and "per rank" in err[0], err
    host = re.search(r"--host-budget >= (\d[\d.]*(?:[KMGT]iB|B))", err[0]).group(1)
    assert plan.main(args + ["--host-budget", host, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["feasible"] and r["per_rank"]["host_bytes"] <= r["per_rank"]["host_budget_bytes"]
    assert r["node"]["host_bytes"] <= r["node"]["host_budget_bytes"] == r["host_budget_bytes"]


def test_zero_readable_summary(capsys):
    assert plan.main(ZMICRO + ["--ranks", "2", "--device-budget", "64MiB"]) == 0
    out = capsys.readouterr().out
    for word in ("ZeRO-3 over 2 ranks", "per rank:", "node (2 ranks)", "tokens/s", "NOT timed",
                 "no collectives", "NOT included: collective time", "no baselines"):
        assert word in out, word


def test_recorded_2gpu_zero3_schedule_reproduced():
    """The 2-GPU ZeRO-3 run (bench_s6b_zero3_2gpu, GPT3_6B, global batch 64): planned here on
    abstract shapes (one CPU device) with its recorded per-rank stage temporaries (32 rows each)
    and rates, at the budget it planned for, the planner gives the schedule that run executed,
    its accounted H2D / D2H, peak, predicted step and collective bytes per rank."""
    path = ROOT / "experiments" / "results" / "bench_s6b_zero3_2gpu.json"
    rec = json.loads(path.read_text())["systems"]["chunkjax"]["extra"]
    inp = plan.prepare("GPT3_6B", 64, 1024, chunk_size=rec["chunk_size"], tide_from=str(path), n_ranks=2)
    assert inp.tide_source.startswith("recorded on gpu") and inp.rank_batch == 32
    r = plan.plan_report("GPT3_6B", rec["effective_budget_bytes"], rec["host_budget_bytes"], 64, 1024,
                         inputs=inp, n_ranks=2, zero_stage=rec["zero_stage"], split=False)  # recorded before the update split
    cb = inp.cb.per_rank(2, rec["zero_stage"])
    _assert_recorded(r["schedule"], rec["schedule"], inp, cb)
    assert r["h2d_bytes_per_step"] == rec["h2d_bytes_per_step_accounted"]
    assert r["d2h_bytes_per_step"] == rec["d2h_bytes_per_step_accounted"]
    assert r["predicted_peak_device_bytes"] == rec["peak_device_bytes_accounted"]
    from chunkjax.program_cut import retime  # the recorded step: the model before the window (issue 23)
    old = retime(Schedule.from_dict(r["schedule"]), cb, chunk_size=inp.layout.chunk_size, traces=inp.traces,
                 tide=inp.tide, rates=inp.problem.rates, flops_per_step=inp.problem.flops_per_step, window=0)
    assert old.time.step_s == pytest.approx(rec["step_s_predicted"])
    assert r["predicted_step_s"] >= old.time.step_s
    assert r["collective_bytes_per_step_per_rank"] == rec["comm_bytes_per_step_per_rank_accounted"]


# ---- a user model given as module:factory, and the plots (issue 22, item 5) -------------------

USER_MODEL = '''
import jax, jax.numpy as jnp
from flax import nnx
from chunkjax import Stage

V, D, L = 96, 32, 3
SDS = jax.ShapeDtypeStruct


def _head(p, x, b):
    logits = (x @ p["out"]).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b[:, 1:, None], -1))


def make(batch, seq):
    """Not a GPT: an embedding, residual MLP blocks and an untied head, on abstract shapes."""
    params = {"emb": SDS((V, D), jnp.float32), "out": SDS((D, V), jnp.float32),
              **{f"mlp_{i}": {"w1": SDS((D, 4 * D), jnp.float32), "w2": SDS((4 * D, D), jnp.float32)}
                 for i in range(L)}}
    stages = [Stage("emb", ("emb",), lambda p, x, b: p["emb"][b[:, :-1]])]
    stages += [Stage(f"mlp_{i}", (f"mlp_{i}",),
                     lambda p, x, b, i=i: x + jnp.tanh(x @ p[f"mlp_{i}"]["w1"]) @ p[f"mlp_{i}"]["w2"])
               for i in range(L)]
    stages.append(Stage("head", ("out",), _head))
    return stages, params, SDS((batch, seq + 1), jnp.int32)


def make_dict():
    stages, params, batch = make(4, 8)
    return {"stages": stages, "params": params, "batch": batch, "name": "mlp-lm"}


def not_a_model(batch, seq):
    return 42


class Block(nnx.Module):
    def __init__(self, d, rngs):
        self.norm, self.up, self.down = nnx.RMSNorm(d, rngs=rngs), nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.silu(self.up(self.norm(x))))


class TinyNNX(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.blocks = nnx.List([Block(D, rngs) for _ in range(L)])
        self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def nnx_loss(model, batch):
    logits = model(batch[:, :-1]).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch[:, 1:, None], -1))


def make_nnx(batch, seq):
    """An NNX model as chunkjax.offload takes it, abstract (nothing allocated)."""
    return nnx.eval_shape(lambda: TinyNNX(nnx.Rngs(0))), nnx_loss, SDS((batch, seq + 1), jnp.int32)


class DropBlock(Block):
    def __init__(self, d, rngs):
        super().__init__(d, rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(self.down(nnx.silu(self.up(self.norm(x)))))


class DropNNX(TinyNNX):
    def __init__(self, rngs):
        super().__init__(rngs)
        self.blocks = nnx.List([DropBlock(D, rngs) for _ in range(L)])


def make_nnx_dropout(batch, seq):
    """The docs' factory with dropout: the abstract model holds an abstract RNG key."""
    return nnx.eval_shape(lambda: DropNNX(nnx.Rngs(0))), nnx_loss, SDS((batch, seq + 1), jnp.int32)
'''


@pytest.fixture
def user_model(tmp_path, monkeypatch):
    (tmp_path / "my_user_model.py").write_text(USER_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    return importlib.import_module("my_user_model")


def test_user_model_factory_plans_and_plots(user_model, tmp_path, capsys):
    """--model module:factory plans the user's stages through the one fit path on abstract shapes:
    the schedule is fit.plan's on fit.prepare of the same model called directly, the report
    names every stage, and --plots writes the four figures."""
    import jax.numpy as jnp

    from chunkjax import PlanError, fit
    from chunkjax.host_update import AdamW

    args = ["--model", "my_user_model:make", "--batch", "2", "--seq", "16"]
    assert plan.main(args + ["--device-budget", "1KiB", "--json"]) == 2
    need = json.loads(capsys.readouterr().out)["min_device_budget_bytes"]
    budget = need + 40_000
    figs = tmp_path / "figs"
    assert plan.main(args + ["--device-budget", str(budget), "--json", "--plots", str(figs)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["model"] == "my_user_model:make" and (r["batch"], r["seq"]) == (2, 16)
    assert r["n_params"] == 96 * 32 * 2 + 3 * 2 * 32 * 128
    assert list(r["stage_temp_bytes"]) == ["emb", "mlp_0", "mlp_1", "mlp_2", "head"]
    stages, params, batch = user_model.make(2, 16)
    problem = fit.prepare(stages, params, batch, host_optimizer=AdamW(1e-4, weight_decay=1e-4),
                          compute_dtype=jnp.bfloat16, host_budget=None, check_host=False)
    want = fit.plan(problem, budget)
    assert r["schedule"] == want.to_dict() and want.predicted.n_fetches > 0
    with pytest.raises(PlanError):
        fit.plan(problem, need - 1)
    assert sorted(p.name for p in figs.iterdir()) == ["device_bytes.png", "placement.png", "schedule.png", "tide.png"]
    assert r["plots"]["tide"] == str(figs / "tide.png")
    # the readable form too, with the figures named
    assert plan.main(args + ["--device-budget", str(budget), "--plots", str(figs)]) == 0
    out = capsys.readouterr().out
    assert "my_user_model:make" in out and "figures: " + str(figs / "tide.png") in out


def test_user_model_factory_without_arguments_and_bad_specs(user_model, capsys):
    """A factory taking no arguments is called without them (its batch shape wins, its name is
    used); bad specs exit 2 with one line saying what to give."""
    assert plan.main(["--model", "my_user_model:make_dict", "--device-budget", "64MiB", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["model"], r["batch"], r["seq"]) == ("mlp-lm", 4, 8)
    for spec, words in [("my_user_model:nope", "has no callable 'nope'"),
                        ("no_such_module_xyz:make", "cannot import 'no_such_module_xyz'"),
                        ("my_user_model:", "module:factory"),
                        ("my_user_model:not_a_model", "must return (stages, params, batch)")]:
        assert plan.main(["--model", spec, "--device-budget", "64MiB"]) == 2
        cap = capsys.readouterr()
        err = cap.err.strip().splitlines()
        assert len(err) == 1 and words in err[0], (spec, err)
    assert plan.main(["--model", "my_user_model:make", "--device-budget", "64MiB", "--tide-from",
                      str(RECORDED)]) == 2
    assert "user model" in capsys.readouterr().err


def test_user_nnx_model_plans_as_offload_does(user_model, capsys):
    """A factory returning (nnx model, loss_fn, batch), the model abstract: the planner finds the
    stages as chunkjax.offload does and plans the schedule offload's step runs (same budget,
    host AdamW, bf16 compute)."""
    import jax.numpy as jnp
    from flax import nnx

    import chunkjax as cj
    from chunkjax.host_update import AdamW

    args = ["--model", "my_user_model:make_nnx", "--batch", "2", "--seq", "16", "--compute-dtype", "bfloat16"]
    assert plan.main(args + ["--device-budget", "1KiB", "--json"]) == 2
    budget = json.loads(capsys.readouterr().out)["min_device_budget_bytes"] + 40_000
    assert plan.main(args + ["--device-budget", str(budget), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["n_params"] == 96 * 32 * 2 + 3 * (32 + 32 * 128 + 128 + 128 * 32 + 32)
    assert (r["batch"], r["seq"]) == (2, 16) and len(r["stage_temp_bytes"]) == 5  # before, 3 blocks, after
    model = user_model.TinyNNX(nnx.Rngs(0))
    step = cj.offload(model, AdamW(1e-4, weight_decay=1e-4), user_model.nnx_loss, jnp.zeros((2, 17), jnp.int32),
                      device_budget=budget, host_budget=None, compute_dtype=jnp.bfloat16)
    assert r["schedule"] == step.schedule.to_dict() and step.schedule.predicted.n_fetches > 0
    assert [s.name for s in step.stages] == list(r["stage_temp_bytes"])


def test_user_nnx_model_with_dropout_plans(user_model, capsys):
    """An abstract model with dropout (its RNG key a ShapeDtypeStruct) plans: the non-parameter
    state stands in as zeros of its shapes, so the FLOP estimate and traces have values."""
    args = ["--model", "my_user_model:make_nnx_dropout", "--batch", "4", "--seq", "16", "--json"]
    assert plan.main(args + ["--device-budget", "1MiB"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["n_params"] == 96 * 32 * 2 + 3 * (32 + 32 * 128 + 128 + 128 * 32 + 32)
    assert len(r["stage_temp_bytes"]) == 5


def test_device_budget_spellings_are_the_front_doors(capsys):
    """--device-budget takes the spellings of chunkjax.budget: 'min' plans at the least budget a
    run can be given (chunkjax.fit.min_budget: what an infeasible plan names over the fit path's
    HEADROOM, as chunkjax.offload's 'min'), 'auto' is refused in one line naming what the CLI takes."""
    import math

    from chunkjax.fit import HEADROOM
    assert plan.main(MICRO + ["--device-budget", "1", "--json"]) == 2
    need = json.loads(capsys.readouterr().out)["min_device_budget_bytes"]
    assert plan.main(MICRO + ["--device-budget", "min", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["feasible"] and r["device_budget_bytes"] == math.ceil(need / HEADROOM) > need
    assert r["device_budget_requested"] == "min"  # the request as given, the bytes it resolved to beside it
    assert plan.main(MICRO + ["--device-budget", "min"]) == 0
    assert f"device budget {r['device_budget_bytes'] / 2**20:.2f} MiB (resolved from 'min')" in capsys.readouterr().out
    assert r["predicted_peak_device_bytes"] <= r["device_budget_bytes"]
    assert plan.main(MICRO + ["--device-budget", "auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'auto' is not supported by the planner CLI" in err[0] and "'min'" in err[0], err


def test_cli_plans_what_offload_plans_for_an_fp32_model(user_model, capsys):
    """The CLI planned every model with bf16 compute, chunkjax.offload an fp32 model in float32
    (its params' dtype): the same budget placed the chunks differently. --compute-dtype auto (the
    default) is what the API does with the same model; bfloat16 asks for mixed precision."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import chunkjax as cj
    from chunkjax.host_update import AdamW

    args = ["--model", "my_user_model:make_nnx", "--batch", "2", "--seq", "16", "--json"]
    model = nnx.eval_shape(lambda: user_model.TinyNNX(nnx.Rngs(0)))
    batch = jax.ShapeDtypeStruct((2, 17), jnp.int32)
    least = cj.plan_offload(model, AdamW(1e-4, weight_decay=1e-4), user_model.nnx_loss, batch, device_budget="min")
    assert plan.main(args + ["--device-budget", "min"]) == 0  # one "min": the front door's is the CLI's
    assert json.loads(capsys.readouterr().out)["device_budget_bytes"] == least.budget_bytes
    budget = least.budget_bytes + least.problem.cb.model_bytes(least.problem.layout.n_chunks) // 2
    api = cj.plan_offload(model, AdamW(1e-4, weight_decay=1e-4), user_model.nnx_loss, batch, device_budget=budget)
    assert jnp.dtype(api.problem.compute_dtype) == jnp.float32
    assert plan.main(args + ["--device-budget", str(budget)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["compute_dtype"] == "float32" and r["placement_counts"] == api.schedule.counts()
    assert r["schedule"] == api.schedule.to_dict()
    assert plan.main(args + ["--device-budget", str(budget), "--compute-dtype", "bfloat16"]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert bf16["compute_dtype"] == "bfloat16" and bf16["placement_counts"] != r["placement_counts"]
    assert plan.main(args + ["--device-budget", str(budget), "--compute-dtype", "int8"]) == 2
    assert "--compute-dtype 'int8': use one of auto, bfloat16" in capsys.readouterr().err
    # the header's model data per param follows the compute dtype: 4-byte float32 compute params
    assert (r["model_bytes_per_param"], bf16["model_bytes_per_param"]) == (16, 14)
    assert r["model_bytes"] == 16 * r["n_params"] and bf16["model_bytes"] == 14 * bf16["n_params"]
    assert plan.main(args[:-1] + ["--device-budget", str(budget)]) == 0
    assert "(16 B/param; " in capsys.readouterr().out


def test_cli_micro_batches_and_storage_plan_as_fit_does(user_model, tmp_path, capsys):
    """--micro-batches and --storage (with --compute-dtype float32) give fit.prepare's problem, so the
    CLI's schedule is fit.plan's for the same inputs: the accumulation, the disk tier's chunks and
    workers, the counts."""
    import jax.numpy as jnp

    import chunkjax as cj
    from chunkjax import fit
    from chunkjax.fit import min_budget
    from chunkjax.host_update import AdamW

    stages, params, batch = user_model.make(4, 16)
    kw = dict(host_optimizer=AdamW(1e-4, weight_decay=1e-4), compute_dtype=jnp.float32, check_host=False)
    args = ["--model", "my_user_model:make", "--batch", "4", "--seq", "16", "--json", "--compute-dtype", "float32"]
    micro = fit.prepare(stages, params, batch, host_budget=None, micro_batches=2, **kw)
    budget = min_budget(micro) + micro.cb.model_bytes(micro.layout.n_chunks) // 4
    want = fit.plan(micro, budget)
    assert plan.main(args + ["--micro-batches", "2", "--device-budget", str(budget)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["compute_dtype"], r["micro_batches"], r["storage_dirs"]) == ("float32", 2, 0)
    assert r["placement_counts"] == want.counts() and r["schedule"] == want.to_dict()

    # one directory: at the least host the disk tier allows, chunks go to disk; two: each worker's
    # staging costs more host than this tiny model's disk chunks save, so the plan keeps every chunk
    # on the host (a model that fits needs no disk) -- the CLI must plan the same either way
    for n in (1, 2):
        dirs = [str(tmp_path / f"d{i}") for i in range(n)]
        with pytest.raises(cj.PlanError) as e:  # the least host the disk tier at its fullest allows
            fit.plan(fit.prepare(stages, params, batch, host_budget=1, storage=dirs, **kw), budget)
        host = e.value.host_need_bytes
        want = fit.plan(fit.prepare(stages, params, batch, host_budget=host, storage=dirs, **kw), budget)
        assert (want.predicted.storage_chunks >= 1) == (n == 1)
        assert plan.main(args + ["--storage", ",".join(dirs), "--host-budget", str(host), "--device-budget",
                                 str(budget)]) == 0, capsys.readouterr().err
        r = json.loads(capsys.readouterr().out)
        assert (r["micro_batches"], r["storage_dirs"]) == (1, n)
        if n == 1:
            assert "storage: " in r["storage"] and want.predicted.storage_workers == 1
        assert r["placement_counts"] == want.counts() and r["schedule"] == want.to_dict()


def test_plots_dir_that_cannot_be_created_is_one_line(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for where, msg in ((afile, "is a file, not a directory"), (afile / "figs", "the directory cannot be created")):
        assert plan.main(MICRO + ["--device-budget", "1GiB", "--plots", str(where)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0] and "give a directory this process can write" in err[0], err
    assert afile.read_text() == "x" and [p.name for p in tmp_path.iterdir()] == ["afile"]


def test_parameter_count_is_written_in_the_fields_units():
    """The plan CLI's header wrote a 921,216-parameter model as ``N=0.000921B`` (a fresh user's report)."""
    from experiments.plan import param_count
    assert [param_count(n) for n in (921_216, 6_160_057_344, 1_300_000, 12)] == ["921K", "6.16B", "1.3M", "12"]


def test_model_data_header_says_which_figure_is_padded(user_model, capsys):
    """The CLI printed "model data 0.01 MiB" and chunkjax.offload's summary another figure for one
    model, neither saying which is which (session 24's trial). Right: the header gives the
    parameters' own bytes and, labelled, the chunks' with their padding, the figure plan_offload's
    problem places (``model_chunk_bytes``, a new key beside ``model_bytes``)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import chunkjax as cj
    from chunkjax.host_update import AdamW

    args = ["--model", "my_user_model:make_nnx", "--batch", "2", "--seq", "16", "--device-budget", "min"]
    assert plan.main(args + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    p = cj.plan_offload(nnx.eval_shape(lambda: user_model.TinyNNX(nnx.Rngs(0))), AdamW(1e-4, weight_decay=1e-4),
                        user_model.nnx_loss, jax.ShapeDtypeStruct((2, 17), jnp.int32))
    assert r["model_chunk_bytes"] == p.problem.model_chunk_bytes > r["model_bytes"] == 16 * r["n_params"]
    assert plan.main(args) == 0
    out = capsys.readouterr().out
    assert (f"model data {r['model_bytes'] / 2**20:.2f} MiB (16 B/param; {r['model_chunk_bytes'] / 2**20:.2f} MiB in "
            "chunks, with padding)") in out, out


def test_clip_expect_defaults_to_the_front_doors_rule(user_model, capsys, monkeypatch):
    """The CLI planned ``--clip-expect rare`` by default while chunkjax.offload plans ``"fires"`` for a
    host spec that clips (its ``clip_expect="auto"``, the documented default). Right: ``auto`` here
    too, with ``--max-grad-norm`` for a clipping host AdamW: the CLI's plan is then the fit path's for
    that spec (fires), ``rare`` on request; the --help states the default."""
    import jax.numpy as jnp

    from chunkjax import fit
    from chunkjax.host_update import AdamW

    monkeypatch.setenv("COLUMNS", "1000")  # argparse's help on one line per option (no wrap at a hyphen)
    with pytest.raises(SystemExit):
        plan.main(["--help"])
    assert "default auto: fires with --max-grad-norm, else rare" in capsys.readouterr().out
    stages, params, batch = user_model.make(2, 16)
    args = ["--model", "my_user_model:make", "--batch", "2", "--seq", "16", "--json"]
    for norm, ask, want in ((None, [], "rare"), (1.0, [], "fires"), (1.0, ["--clip-expect", "rare"], "rare")):
        spec = AdamW(1e-4, weight_decay=1e-4, max_grad_norm=norm)
        problem = fit.prepare(stages, params, batch, host_optimizer=spec, compute_dtype=jnp.bfloat16, host_budget=None,
                              check_host=False, **({"clip_expect": ask[1]} if ask else {}))
        assert problem.clip_expect == want
        budget = fit.min_budget(problem) + problem.model_chunk_bytes // 2
        flags = ["--max-grad-norm", str(norm)] if norm else []
        assert plan.main(args + flags + ask + ["--device-budget", str(budget)]) == 0
        r = json.loads(capsys.readouterr().out)
        assert (r["clip_expect"], r["max_grad_norm"]) == (want, norm)
        assert r["schedule"] == fit.plan(problem, budget).to_dict()
        assert (r["if_clipped"] is None) == (want == "fires")
    assert plan.main(args + ["--max-grad-norm", "0", "--device-budget", "1MiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--max-grad-norm 0.0: give a global norm > 0" in err[0], err
    # fires without clipping (fresh25: it planned a slower step for a norm nothing waits for)
    assert plan.main(args + ["--clip-expect", "fires", "--device-budget", "1MiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--clip-expect fires needs clipping: add --max-grad-norm" in err[0], err


def test_a_budget_below_the_chunk_buffers_names_the_least_budget_not_the_batch(capsys):
    """``--device-budget 1`` said "... or lower the batch": no batch fits 1 byte. Right: one line
    naming the least budget (``min_device_budget_bytes``, in the unit that fits it), which plans."""
    from chunkjax.errors import format_bytes
    assert plan.main(MICRO + ["--device-budget", "1", "--json"]) == 2
    cap = capsys.readouterr()
    need, err = json.loads(cap.out)["min_device_budget_bytes"], cap.err.strip().splitlines()
    assert len(err) == 1 and "lower the batch" not in err[0] and "chunk buffers alone" in err[0], err
    assert err[0].endswith(f">= {format_bytes(need, up=True)}"), err
    assert plan.main(MICRO + ["--device-budget", format_bytes(need, up=True), "--json"]) == 0


@pytest.mark.parametrize("model", ["micro", "my_user_model:make", "my_user_model:make_nnx"])
@pytest.mark.parametrize("shape", [["--batch", "-3", "--seq", "16"], ["--batch", "2", "--seq", "0"]])
def test_batch_and_seq_below_1_exit_2_for_every_model_kind(model, shape, user_model, monkeypatch, capsys):
    """--batch / --seq below 1 are refused with one line and exit 2 for named models and factories
    alike (fresh25: a factory gave a raw JAX traceback for --batch -3 and planned --seq 0), before
    a factory is called or a model traced."""
    def never(*a, **k):
        raise AssertionError("nothing is traced for a bad --batch / --seq")
    monkeypatch.setattr(plan, "trace_inputs", never)
    monkeypatch.setattr(plan, "trace_user_model", never)
    monkeypatch.setattr(plan, "call_factory", never)
    assert plan.main(["--model", model, "--device-budget", "min"] + shape) == 2
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --batch and --seq must be >= 1"), err
    assert cap.out == ""
    with pytest.raises(ValueError, match="--batch and --seq must be >= 1"):  # the library path too
        (_trace_user if ":" in model else _trace)(model, int(shape[1]), int(shape[3]))
