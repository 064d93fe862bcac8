"""Issue 9 on the CPU: the DeepSpeed configs carry the benchmark settings, peer records use the
same FLOP formula as the bench, and the driver refuses a mismatched chunkjax reference and bad
input (the peers themselves run only on the GPU machine)."""
import json
import subprocess
import sys

import pytest

from experiments.peers import common, run_peers
from models import gpt


def test_ds_configs_are_the_benchmark_settings():
    off = common.ds_config("ds_zero_offload", 16)
    assert off["zero_optimization"]["stage"] == 2 and off["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "offload_param" not in off["zero_optimization"]
    assert off["bf16"] == {"enabled": True} and off["gradient_clipping"] == 0.0
    assert off["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 1e-4, "betas": [0.9, 0.999],
                                                            "eps": 1e-8}}
    assert off["train_micro_batch_size_per_gpu"] == 16 and off["gradient_accumulation_steps"] == 1
    inf = common.ds_config("ds_zero_infinity", 32, nvme_dir="/nvme")
    z = inf["zero_optimization"]
    assert z["stage"] == 3 and z["offload_param"]["device"] == z["offload_optimizer"]["device"] == "nvme"
    assert z["offload_param"]["nvme_path"] == "/nvme"
    with pytest.raises(ValueError, match="unknown peer"):
        common.ds_config("colossal", 1)


def test_peer_record_uses_the_bench_flop_formula():
    cfg = gpt.get_config("GPT2_1B")
    rec = common.peer_record({"model": "GPT2_1B", "batch": 16, "seq": 1024, "step_s_all": [1.0, 0.5, 2.0],
                              "torch_matmul_tflops": 700.0, "losses": [11.0, 10.5], "feasible": True}, 600.0)
    assert rec["step_s_median"] == 1.0 and rec["tokens_per_s"] == 16 * 1024
    assert rec["tflops"] == pytest.approx(16 * 1024 * cfg.flops_per_token(1024) / 1e12)
    assert rec["mfu"] == pytest.approx(rec["tflops"] / 600.0)
    assert rec["mfu_torch_matmul"] == pytest.approx(rec["tflops"] / 700.0)
    assert rec["loss_falling"] and rec["losses_finite"]
    bad = common.peer_record({"model": "GPT2_1B", "batch": 1, "seq": 8, "losses": [1.0, float("nan")],
                              "feasible": True})
    assert bad["feasible"] is False and "non-finite" in bad["error"]


def test_reference_and_ratios(tmp_path):
    bench_json = tmp_path / "bench_x.json"
    bench_json.write_text(json.dumps({"run_id": "x", "model": "GPT2_1B", "batch": 16, "seq": 1024,
                                      "device_budget_bytes": 2 ** 34, "matmul_tflops": 600.0,
                                      "systems": {"chunkjax": {"tokens_per_s": 40000.0, "feasible": True}}}))
    ref = run_peers.reference_rows(str(bench_json), "GPT2_1B", 16, 1024, 2 ** 34)
    assert ref["chunkjax"]["tokens_per_s"] == 40000.0 and ref["chunkjax"]["matmul_tflops"] == 600.0
    with pytest.raises(ValueError, match="batch=16"):
        run_peers.reference_rows(str(bench_json), "GPT2_1B", 8, 1024, 2 ** 34)
    res = {"run_id": "p", "model": "GPT2_1B", "batch": 16, "seq": 1024, "device_budget_bytes": 2 ** 34,
           "reference": ref, "systems": {"ds_zero_offload": {"feasible": True, "tokens_per_s": 16000.0},
                                         "ds_zero_infinity": {"feasible": False, "error": "CUDA out of memory"}}}
    r = run_peers.ratios(res)
    assert r == {"ds_zero_offload": 2.5, "ds_zero_infinity": None}
    res["ratios"] = r
    md = run_peers.render_markdown(res, "experiments/results/peers_p.json")
    assert "| 2.50x |" in md and "CUDA out of memory" in md and md.startswith("<!-- peers:p:start -->")


BAD_INPUT = [
    (["--systems", "colossal", "--run-id", "a"], "choose from"),
    (["--systems", "ds_zero_offload"], "--run-id is required"),
    (["--run-id", "a", "--device-budget", "lots"], ""),
    (["--report", "/nonexistent.json"], "no such file"),
    (["--model", "nope"], "unknown model 'nope'"),
]


@pytest.mark.parametrize("argv, msg", BAD_INPUT)
def test_bad_input_exits_2(argv, msg, capsys):
    """Each bad input: exit status 2 and the message, no traceback (main() in this process: the
    command-line entry point itself is run once, below)."""
    assert run_peers.main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_bad_input_exits_2_subprocess():
    argv, msg = BAD_INPUT[-1]
    p = subprocess.run([sys.executable, "-m", "experiments.peers.run_peers", *argv], capture_output=True, text=True)
    assert p.returncode == 2, p.stderr
    assert msg in p.stderr and "Traceback" not in p.stderr
