"""Planner CLI (issue 3 groundwork): JSON keys, baselines, and the infeasible-budget error."""
import json

from experiments import plan

KEYS = ["predicted_peak_device_bytes", "device_budget_bytes", "h2d_bytes_per_step", "d2h_bytes_per_step",
        "predicted_step_s", "n_chunks", "chunk_size", "placement_counts", "baselines"]


def test_plan_json_and_baselines(capsys):
    assert plan.main(["--model", "micro", "--device-budget", "8MiB", "--batch", "2", "--seq", "64", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    for k in KEYS:
        assert k in r, k
    assert set(r["baselines"]) == {"all_host", "zero_offload"}
    for b in r["baselines"].values():
        for k in ("feasible", "predicted_peak_device_bytes", "h2d_bytes_per_step", "d2h_bytes_per_step",
                  "predicted_step_s"):
            assert k in b
    ah = r["baselines"]["all_host"]
    # the chunkjax plan fits and never moves more bytes than streaming everything
    assert r["feasible"] and r["predicted_peak_device_bytes"] <= r["device_budget_bytes"]
    assert r["h2d_bytes_per_step"] <= ah["h2d_bytes_per_step"]
    # zero-offload keeps compute params on the device: no fetches, only grads down / params up
    zo = r["baselines"]["zero_offload"]
    assert zo["h2d_bytes_per_step"] == zo["d2h_bytes_per_step"] > 0


def test_plan_infeasible_exits_2(capsys):
    assert plan.main(["--model", "micro", "--device-budget", "100KiB", "--batch", "2", "--seq", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "use --device-budget >=" in err[0]


def test_plan_readable_summary():
    out = plan._summary(plan.plan_report("micro", 8 * 2**20, None, 2, 64))
    assert "chunkjax" in out and "all_host" in out and "zero_offload" in out and "where the time goes" in out
