"""experiments/gpu_checks/dropin.py on a tiny model on the CPU: the systems it compares train the
same numbers as ``nnx.Optimizer`` (float32, so to float32 rounding), and each row's host bytes per
parameter is the system's own (0 only where everything is on the device; null where unrecorded)."""
import json

from experiments.gpu_checks import dropin


def test_tiny_systems_equal_nnx_optimizer_and_report_their_host_bytes(tmp_path):
    rc = dropin.main(["--tiny", "--systems", "nnx,injit_tied,front", "--run", "t", "--out", str(tmp_path),
                      "--total", "400", "--timeout", "200"])
    res = json.loads((tmp_path / "dropin_t.json").read_text())
    s = res["systems"]
    assert rc == 0, {k: v.get("error") or v.get("stderr") for k, v in s.items()}
    diff = res["max_loss_rel_diff"]
    assert diff["injit_tied"] < 1e-6 and diff["front"] < 1e-5, diff  # fp32 on the CPU
    assert len(s["nnx"]["losses"]) == len(s["injit_tied"]["losses"]) >= 3
    assert s["nnx"]["host_bytes_per_param"] == 0.0
    assert s["injit_tied"]["host_bytes_per_param"] == 8.0  # AdamW's two float32 moments
    assert s["front"]["host_bytes_per_param"] > 4.0  # its host chunks' master params and state
