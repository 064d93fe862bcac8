"""The benchmark driver's time limit: a worker that runs out of time leaves what it measured.

On the GPU a part of experiments/gpu_checks/largest.sh ran 583 s under an outer ``timeout`` while its
worker had been given 568 s after a ~20 s matmul probe: the driver was killed first and the steps the
worker had finished were lost. ``--time-limit`` gives each subprocess what is left of the call, and
the worker's progress lines reach the driver's log as they are printed."""
import sys
import time
import types

from experiments import bench, measure


def test_progress_lines_reach_the_log_live_and_survive_a_timeout(capsys):
    line = measure.PROGRESS_TAG + ' {"phase": "init", "seconds": 1.5}'
    code = (f"import sys, time; print({line!r}, file=sys.stderr, flush=True); "
            "print('compiler noise', file=sys.stderr, flush=True); print('out', flush=True); time.sleep(60)")
    t0 = time.monotonic()
    rc, out, err, timed_out = bench.stream_process([sys.executable, "-c", code], None, 3.0,
                                                   echo_prefixes=(measure.PROGRESS_TAG,))
    wall = time.monotonic() - t0
    assert timed_out and rc == 124 and wall < 30
    echoed = capsys.readouterr().out
    assert line in echoed and "compiler noise" not in echoed  # only progress lines are echoed
    assert line in err and "compiler noise" in err and out == "out\n"  # and everything is kept


def test_a_finished_child_keeps_its_status_and_output():
    rc, out, err, timed_out = bench.stream_process(
        [sys.executable, "-c", "import sys; print('a'); print('b', file=sys.stderr); sys.exit(3)"], None, 30.0)
    assert (rc, out, err, timed_out) == (3, "a\n", "b\n", False)


def test_worker_timeout_is_what_is_left_of_the_time_limit():
    now = time.monotonic()
    a = types.SimpleNamespace(worker_timeout=0, time_limit=100.0, started_at=now - 50.0)
    left = bench.worker_timeout(a)
    assert 100.0 - 50.0 - bench.TIME_LIMIT_MARGIN_S - 1.0 < left <= 100.0 - 50.0 - bench.TIME_LIMIT_MARGIN_S
    a.worker_timeout = 20.0
    assert bench.worker_timeout(a) == 20.0  # the smaller of the two
    a.started_at = now - 500.0
    assert bench.worker_timeout(a) == 1.0  # spent: the next child still starts and is stopped at once
    assert bench.worker_timeout(types.SimpleNamespace(worker_timeout=0, time_limit=0, started_at=now)) is None


def test_the_parser_takes_a_time_limit():
    a = bench.build_parser().parse_args(["--time-limit", "570"])
    assert a.time_limit == 570.0 and a.worker_timeout == 0


def test_a_warm_up_without_a_timed_step_is_kept_as_such():
    lines = [measure.PROGRESS_TAG + ' {"phase": "compile", "seconds": 200.0}',
             measure.PROGRESS_TAG + ' {"phase": "init", "seconds": 120.0}',
             measure.PROGRESS_TAG + ' {"phase": "warmup", "seconds": 118.5, "loss": 11.7}']
    part = measure.partial_from_progress(lines, 8, 1024)
    assert part == {"compile_s": 200.0, "init_s": 120.0, "warmup_s": 118.5, "losses": [11.7],
                    "losses_finite": True, "loss_falling": None}  # no tokens/s


def test_a_largest_run_stopped_after_a_timed_step_trains_beside_its_plan(tmp_path):
    """s20a2 on the H200: GPT3_15B b64 finished its warm-up and one timed step, then the time limit
    stopped the worker before its record. The largest block said ``ok: False`` (no ``loss_falling``
    in the partial record) and kept no prediction. Now the partial record has both, and the plan's
    line (step seconds, disk bytes) is kept beside the measured step."""
    import json

    def line(**kw):
        return measure.PROGRESS_TAG + " " + json.dumps(kw)

    plan = {"step_s_predicted": 101.5, "peak_device_bytes_accounted": 133_000, "host_bytes_accounted": 116_000,
            "micro_batches": 8, "schedule_counts": {"update_storage": 3},
            "storage": {"storage_chunks": 3, "disk_bytes_per_step_accounted": 1.2e11}}
    tails = {"micro": [line(phase="compile", seconds=80.0), line(phase="plan", **plan),
                       line(phase="init", seconds=110.0), line(phase="warmup", seconds=114.7, loss=11.65),
                       line(phase="step", seconds=106.6, loss=11.55, update_s=94.7)],
             "tiny": [line(phase="compile", seconds=80.0), line(phase="plan", **plan),
                      line(phase="warmup", seconds=114.7, loss=11.65), line(phase="step", seconds=99.0, loss=float("nan"))]}

    def runner(argv, env, timeout, log_path=None):
        if "--probe" in argv:
            return {"rc": 0, "json": {"matmul_tflops": 10.0}, "stderr_tail": []}
        model = argv[argv.index("--model") + 1]
        return {"rc": 124, "json": None, "timed_out": True, "stderr_tail": tails[model]}

    assert bench.main(["--largest", "--largest-models", "micro,tiny", "--largest-keep-going", "--largest-batch", "4",
                       "--largest-seq", "16", "--systems", "chunkjax", "--run-id", "T", "--results-dir", str(tmp_path),
                       "--time-limit", "600"], runner=runner) == 0
    tried = json.loads((tmp_path / "bench_T.json").read_text())["largest"]["chunkjax"]["tried"]
    m = tried["micro"]
    assert m["ok"] and m["losses"] == [11.65, 11.55] and m["step_s_median"] == 106.6
    assert m["step_s_predicted"] == 101.5 and m["micro_batches"] == 8 and m["storage"]["storage_chunks"] == 3
    assert not tried["tiny"]["ok"]  # a non-finite loss never counts as training


def test_a_timed_out_child_leaves_its_stack_and_whole_stderr_in_the_log(tmp_path):
    """s22b2: the worker timed out and its last 40 stderr lines said only "Finished tracing ...": the
    log keeps every line with its time, and the SIGABRT at the limit adds where the child was."""
    log = tmp_path / "w.stderr.log"
    code = ("import faulthandler, sys, time\nfaulthandler.enable()\n"
            "for i in range(100): print(f'noise {i}', file=sys.stderr, flush=True)\n"
            "def stuck_in_here():\n    time.sleep(60)\nstuck_in_here()\n")
    t0 = time.monotonic()
    rc, out, err, timed_out = bench.stream_process([sys.executable, "-c", code], None, 3.0, log_path=str(log))
    assert timed_out and rc == 124 and time.monotonic() - t0 < 3.0 + bench.ABORT_GRACE_S + 10
    text = log.read_text()
    lines = text.splitlines()
    assert lines[0].split(None, 1)[1] == "noise 0" and "noise 99" in text  # every line, not a tail
    assert float(lines[0].split()[0]) < 3.0  # prefixed with the seconds since the start
    assert "stuck_in_here" in text and "stuck_in_here" in err  # the stack at the limit
