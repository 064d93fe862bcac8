"""The issue-3 budget sweep (experiments/sweep.py) end to end on the CPU: every configuration
plans, compiles, trains from one shared host-side initialisation and reports its figures.

On the CPU memory kinds compile to nothing: bytes moved and step times are measured on the GPU
(docs/benchmarks.md); here the bookkeeping is checked."""
import json
import math

import chunkjax as cj
from experiments import sweep

from _shared_data import two_block_micro


def test_sweep_micro(tmp_path, monkeypatch):
    # The two sweep calls below trace the same model, layout and batch shape: the second reuses
    # the first's stage traces (a deterministic function of these; measured 6.7 s a call on the
    # CPU) instead of compiling them again. Everything the sweep plans, compiles and runs is redone.
    traced, real_trace = {}, cj.trace_stages

    def trace_once(stages, layout, batch, compute_dtype):
        key = (tuple(st.name for st in stages), repr(layout), batch.shape, str(batch.dtype), str(compute_dtype))
        if key not in traced:
            traced[key] = real_trace(stages, layout, batch, compute_dtype)
        return traced[key]

    monkeypatch.setattr(cj.fit, "trace_stages", trace_once)  # the sweep traces through the fit path
    with two_block_micro():  # the micro GPT with 2 blocks: smaller programs to trace and compile
        _sweep_micro(tmp_path, traced)


def _sweep_micro(tmp_path, traced):
    out = tmp_path / "res"
    docs = tmp_path / "bench.md"
    common = ["--model", "micro", "--batch", "2", "--seq", "32", "--rounds", "2", "--steps", "2", "--run-id", "t",
              "--results-dir", str(out)]
    # the tide plans in one call, the baselines in another: one file, budgets merged
    assert sweep.main(common + ["--plans", "tide", "--budgets", "64MiB,2GiB"]) == 0
    assert set(json.loads((out / "sweep_t.json").read_text())["configs"]) == {"tide@0.0625GiB", "tide@2GiB"}
    assert sweep.main(common + ["--plans", "all_host", "--budgets", "64MiB,2GiB"]) == 0
    res = json.loads((out / "sweep_t.json").read_text())
    cf = res["configs"]
    assert set(cf) == {"tide@0.0625GiB", "tide@2GiB", "all_host"}
    for name, r in cf.items():
        assert len(r["step_s_all"]) == 4, name  # 2 rounds x 2 timed steps
        assert r["losses_finite"] and len(r["losses"]) == 6 and len(r["step_s_warmup"]) == 2
        assert all(math.isfinite(x) for x in r["losses"])
        assert r["step_s_std"] >= 0 and r["tokens_per_s"] > 0
        assert r["predicted_peak_device_bytes"] > 0 and r["compiled_peak_bytes"] > 0
        if r["schedule_counts"].get("params_pinned_host/update_host"):  # the host thread's time is measured
            assert len(r["host_update_s_all"]) == 4 and r["host_update_s_median"] > 0
    # all_host fetches at every read: never fewer bytes than chunkjax's plan
    for b in ("tide@0.0625GiB", "tide@2GiB"):
        assert cf[b]["h2d_bytes_per_step_predicted"] <= cf["all_host"]["h2d_bytes_per_step_predicted"]
    # the roomy budget keeps chunks on the device
    assert any(k.startswith("params_device") for k in cf["tide@2GiB"]["schedule_counts"])
    # training went on between rounds from the shared host state: the all_host losses fall
    ah = cf["all_host"]["losses"]
    assert ah[-1] < ah[0]
    assert len(traced) == 1  # both calls traced the one model
    assert sweep.main(["--report", str(out / "sweep_t.json"), "--docs", str(docs)]) == 0
    text = docs.read_text()
    assert len(res["commands"]) == 2
    assert "Budget sweep `t`" in text and text.count("| 0.0625 |") == 2 and text.count("| 2 |") == 2


def test_sweep_bad_input(capsys):
    assert sweep.main(["--budgets", "lots"]) == 2
    assert "--budgets" in capsys.readouterr().err
    assert sweep.main(["--plans", "all_device"]) == 2


def test_unknown_model_exits_2(tmp_path, capsys):
    assert sweep.main(["--model", "nope", "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown model 'nope'" in err[0]
