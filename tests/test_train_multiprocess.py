"""The main job as 2 processes (issue 20, item 6): ``python -m experiments.train --zero-stage 3``
started twice with ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` (4 forced
CPU devices each, CPU collectives through gloo: tests/_multiprocess.py) trains the losses of the
single-process 8-device ``--zero-stage 3`` run, checkpoints through the multi-process save, and
writes one run folder. Bad combinations exit 2 with one line. Run as a script, this file is one
process of that job: ``python tests/test_train_multiprocess.py PROCESS_ID N PORT DATA_CACHE OUT_DIR``."""
import json
import os
import pathlib
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module", autouse=True)
def _two_block_micro():
    """``--model micro`` with 2 blocks in this module (tests/_shared_data.py: two_block_micro)."""
    from _shared_data import two_block_micro
    with two_block_micro():
        yield


def _args(data_cache, out, *extra):
    # the micro GPT (2 blocks: tests/_shared_data.py's two_block_micro), fp32, 3 steps of 8 rows (one
    # per device), evaluation and a checkpoint at steps 2 and 3 (every process calls the save), a
    # sample at the end (master_params gathered)
    return ["--model", "micro", "--tokenizer", "bpe512", "--data-cache", str(data_cache), "--out-dir", str(out),
            "--batch", "8", "--seq", "32", "--steps", "3", "--eval-every", "2", "--eval-batches", "2",
            "--sample-tokens", "4", "--no-progress", "--lr", "1e-2", "--compute-dtype", "float32",
            "--zero-stage", "3", *extra]


def _curve(run):
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    return [r.get("loss") for r in recs if r.get("loss") is not None], [r["val_loss"] for r in recs if "val_loss" in r]


def test_two_processes_train_the_single_process_losses(tmp_path, zero3_job_single_process):
    import numpy as np
    from _multiprocess import run_processes
    from _shared_data import bpe512_cache

    data = bpe512_cache()
    two = tmp_path / "two"
    run1 = zero3_job_single_process  # _args in this pytest process: 8 forced CPU devices (conftest.py)
    run_processes("test_train_multiprocess.py", lambda i: (data, two), timeout=240)
    (run2,) = two.iterdir()  # process 1 wrote no folder of its own
    assert not run2.name.endswith(".partial")
    assert sorted(p.name for p in run2.iterdir()) == sorted(p.name for p in run1.iterdir())
    rep = json.loads((run2 / "report.json").read_text())
    assert rep["n_devices"] == 8 and rep["zero_stage"] == 3 and rep["checkpoints_saved"] == 2
    assert sorted(p.name for p in (run2 / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]
    (l1, v1), (l2, v2) = _curve(run1), _curve(run2)
    assert len(l1) == len(l2) == 3 and len(v1) == len(v2) == 3
    np.testing.assert_allclose(l2, l1, rtol=2e-5)  # tests/test_zero_multiprocess.py's tolerance
    np.testing.assert_allclose(v2, v1, rtol=2e-5)
    assert (run2 / "sample.txt").read_text() == (run1 / "sample.txt").read_text()


def test_several_processes_need_a_zero_stage(tmp_path, monkeypatch, capsys):
    from experiments import train
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    args = _args(tmp_path / "data", tmp_path / "out")
    assert train.main(args[:-2] + ["--zero-stage", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--zero-stage" in err[0], err
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    assert train.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "JAX_PROCESS_ID" in err[0], err
    monkeypatch.delenv("JAX_NUM_PROCESSES")
    assert train.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "JAX_NUM_PROCESSES" in err[0], err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


if __name__ == "__main__":  # one process of the 2-process job (tests/_multiprocess.py launches it)
    sys.path.insert(0, os.path.dirname(HERE))
    pid, n, port, data, out = sys.argv[1:]
    os.environ.update(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=n, JAX_PROCESS_ID=pid)
    sys.path.insert(0, HERE)
    from _shared_data import two_block_micro

    from experiments import train
    with two_block_micro():  # the model of the single-process run it is compared with
        sys.exit(train.main(_args(pathlib.Path(data), pathlib.Path(out))))
