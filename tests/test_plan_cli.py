"""Planner CLI (issue 3, items 4-5): JSON keys, baselines planned over the same tide, the
infeasible-budget errors, the GPU-recorded tide, and the recorded GPT3_6B schedule reproduced."""
import json
import pathlib
import re

import pytest

from chunkjax.schedule import HOST_UPDATE, plan_schedule
from experiments import plan

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORDED = ROOT / "experiments" / "results" / "bench_s3c_gpt3_6b_24g.json"
KEYS = ["predicted_peak_device_bytes", "device_budget_bytes", "h2d_bytes_per_step", "d2h_bytes_per_step",
        "predicted_step_s", "n_chunks", "chunk_size", "placement_counts", "baselines"]
MICRO = ["--model", "micro", "--batch", "2", "--seq", "64"]
_CACHE: dict = {}
_trace = plan.trace_inputs


@pytest.fixture(autouse=True)
def cached_trace(monkeypatch):
    """Trace each (model, batch, seq) once for the whole module (tracing is the slow part)."""
    def trace_inputs(model, batch, seq, **kw):
        key = (model, batch, seq, kw.get("chunk_size"), kw.get("min_chunks", 8))
        if key not in _CACHE:
            _CACHE[key] = _trace(model, batch, seq, **kw)
        return _CACHE[key]

    monkeypatch.setattr(plan, "trace_inputs", trace_inputs)


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
    ah = plan.fixed_schedule("all_host", inp.layout, inp.traces, tide, cb, big, flops_per_step=inp.flops_per_step)
    assert [set(f) for f in ah.fetch] == [set(m.chunks) for m in tide.moments]
    assert ah.predicted.n_fetches == sum(len(set(m.chunks)) for m in tide.moments)
    assert ah.update_locations == (HOST_UPDATE,) * n
    res = ah.residency()
    for t, m in enumerate(tide.moments):  # on the device exactly while read
        assert {c for c in range(n) if res[c][t]} == set(m.chunks)
        assert ah.predicted.device_bytes_per_moment[t] >= m.non_model_bytes + len(set(m.chunks)) * cb.params
    belady = plan_schedule(inp.layout, inp.traces, cb, big, flops_per_step=inp.flops_per_step, resident=[])
    assert ah.predicted.h2d_bytes_per_step >= belady.predicted.h2d_bytes_per_step
    zo = plan.fixed_schedule("zero_offload", inp.layout, inp.traces, tide, cb, big, flops_per_step=inp.flops_per_step)
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
        kinds = plan.device_bytes_by_kind(s, inp)
        assert all(min(v) >= 0 for v in kinds.values())
        assert [sum(x) for x in zip(*kinds.values())] == list(s.predicted.device_bytes_per_moment)
    assert plan.device_bytes_by_kind(zo, inp)["resident model data"] == [0] * len(tide.moments)


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
    host = re.search(r"--host-budget >= (\S+GiB)", err[0]).group(1)
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
    out = plan._summary(plan.plan_report("micro", 8 * 2**20, None, 2, 64))
    for word in ("chunkjax", "all_host", "zero_offload", "where the time goes", "exposed host update",
                 "estimated on cpu", "programs"):
        assert word in out, word


def test_recorded_gpt3_6b_schedule_reproduced():
    """The one big config: on the CPU, with the GPU run's stage temporaries and rates, the planner
    gives exactly the schedule that run executed (at the budget it planned for after its compile
    check), and its predictions."""
    rec = json.loads(RECORDED.read_text())["systems"]["chunkjax"]["extra"]
    inp = plan.prepare("GPT3_6B", 32, 1024, tide_from=str(RECORDED))
    assert inp.tide_source.startswith("recorded on gpu")
    sched, base = plan.plan_schedules(inp, rec["effective_budget_bytes"])
    assert sched.to_dict() == rec["schedule"]
    assert plan.schedule_from_dict(rec["schedule"]) == sched
    kinds = plan.device_bytes_by_kind(sched, inp)
    assert all(min(v) >= 0 for v in kinds.values())
    assert [sum(x) for x in zip(*kinds.values())] == list(sched.predicted.device_bytes_per_moment)
    assert base["all_host"].predicted.h2d_bytes_per_step > sched.predicted.h2d_bytes_per_step
