"""What a fresh user found wrong in the fine-tuning tool (experiments/train.py), each fixed for
its kind: byte counts printed in GiB whatever their size, ``--help`` showing the random-init
defaults under ``--init-from``, ``--storage`` directories checked only when the plan used them,
and a diverged run ending with exit 0. (The tied/untied head of a Hugging Face folder:
tests/test_hf.py.)"""
import contextlib
import dataclasses
import io
import os
import pathlib

import numpy as np
import pytest

from chunkjax.errors import format_bytes, format_moved_bytes
from chunkjax.plan import parse_bytes
from experiments import train

ROOT = pathlib.Path(__file__).resolve().parents[1]
QWEN2 = str(ROOT / "tests" / "fixtures" / "hf_qwen2")


def test_format_bytes_picks_the_unit_and_rounds_hints_up():
    assert [format_bytes(n) for n in (0, 512, 1024, 1536, 311428, 8 * 2**30, 2**30 - 1)] == \
        ["0B", "512B", "1.000KiB", "1.500KiB", "304.129KiB", "8.000GiB", "1.000GiB"]
    for n in (1, 1023, 1025, 311428, 2**20 + 1, 2**30 + 1, 123456789012):
        text = format_bytes(n, up=True)
        assert parse_bytes(text) >= n and float(text.rstrip("BKMGTi")) >= 1, (n, text)  # a hint that works
    assert format_bytes(2**20 + 1, up=True) == "1.001MiB"
    # bytes moved (per step, over a link) print in decimal units, as link rates and the benchmarks' GB/step
    assert [format_moved_bytes(n) for n in (0, 999, 1000, 47185920, 1.2e9, 2**40)] == \
        ["0B", "999B", "1.000kB", "47.186MB", "1.200GB", "1.100TB"]


def _help(argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        train.parse_args(argv + ["--help"])
    return " ".join(out.getvalue().split())


def test_help_shows_the_defaults_that_run(monkeypatch):
    """``--help`` listed the random-init defaults (--lr 0.003) though a Hugging Face folder runs
    with its preset's (--lr 5e-05). It now says both, and with --init-from that preset's are the
    defaults it shows, equal to what parse_args resolves."""
    monkeypatch.setenv("COLUMNS", "400")  # argparse breaks long words ("--init- from") at the terminal width
    plain = _help([])
    assert "(default: 0.003; with --init-from a Hugging Face folder: 5e-05, smollm2-135m: 0.0002)" in plain
    assert "(default: 400; with --init-from a Hugging Face folder: 200" in plain
    assert "(default: 1.0)" in plain  # --clip: no preset changes it
    folder = _help(["--init-from", QWEN2])
    cfg = train.parse_args(["--init-from", QWEN2])
    assert f"(default with --init-from {QWEN2}: {cfg.lr}; random init: 0.003)" in folder
    assert f"(default with --init-from {QWEN2}: {cfg.steps}; random init: 400)" in folder
    assert f"tokens per sequence (default: {cfg.seq})" in folder  # the folder's 128 positions = the default
    assert train.parse_args(["--init-from", QWEN2, "--lr", "1e-3"]).lr == 1e-3  # flags given win


def test_storage_checked_at_start_even_when_not_needed(tmp_path, capsys):
    """A --storage directory was checked only when the plan put chunks on disk. Every one is now
    checked by writing before any work (one line, exit 2, nothing written), and its free space
    printed; a missing one is created and removed again."""
    lines = train.check_storage_dirs([str(tmp_path / "new" / "d0"), str(tmp_path)])
    assert lines[0].startswith(f"storage: {tmp_path / 'new' / 'd0'} (created when used), ") and lines[0].endswith(" free")
    assert "(exists)" in lines[1] and os.listdir(tmp_path) == []  # nothing left behind
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    bad = [str(blocker / "d")]
    if os.geteuid() == 0 and os.path.isdir("/sys/kernel"):  # root: os.access says yes, the filesystem no
        bad.append("/sys/chunkjax-storage-check/d")
    for d in bad:
        out = tmp_path / "runs"
        assert train.main(["--model", "micro", "--storage", d, "--out-dir", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("error: ") and d.split("/d")[0] in err, err
        assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == ["afile"] and not os.path.exists("/sys/chunkjax-storage-check")


def test_divergence_watch_rules():
    """Under --nonfinite error a non-finite loss or gradient norm stops at once (the gradient norm
    was not checked: its update reached the next checkpoint); under skip, --skip-limit skipped
    steps in a row stop; a gradient norm of exactly 0 at a positive loss DEAD_STEPS times in a row
    stops (a loss of 0, no scored target, does not count); a healthy step ends a run of them."""
    w = train.DivergenceWatch(skip_limit=3, lr=1e4)
    for i, (loss, gn) in enumerate([(5.0, 1.0), (0.0, 0.0), (5.6, 0.0), (5.6, 0.0), (5.0, 1.0)], 1):
        w.observe(i, loss, gn, False)
    assert not w.suspect
    with pytest.raises(train.Diverged, match="gradient norm became inf at step 7"):
        w.observe(7, 5.0, float("inf"), False)
    with pytest.raises(train.Diverged, match="loss became nan at step 8: lower --lr"):
        w.observe(8, float("nan"), float("nan"), False)
    w = train.DivergenceWatch(skip_limit=3, lr=1e4)
    w.observe(1, float("nan"), float("nan"), True)
    w.observe(2, 5.0, 1.0, False)  # one bad batch, then training goes on
    w.observe(3, float("nan"), 0.0, True)
    w.observe(4, float("inf"), 0.0, True)
    assert w.suspect and w.since == 3
    with pytest.raises(train.Diverged) as e:
        w.observe(5, float("nan"), 0.0, True)
    assert e.value.record["why"] == "skip_limit" and e.value.record["since_step"] == 3
    assert "steps 3-5 all had non-finite gradients (--skip-limit 3 in a row skipped)" in str(e.value)
    for i in range(1, train.DEAD_STEPS):
        w = w if i > 1 else train.DivergenceWatch(skip_limit=3, lr=1e4)
        w.observe(i, 5.66, 0.0, False)
    with pytest.raises(train.Diverged, match="gradient norm of 0 at loss 5.6600") as e:
        w.observe(train.DEAD_STEPS, 5.66, 0.0, False)
    assert e.value.record["why"] == "dead" and e.value.record["since_step"] == 1


def test_divergence_watch_stops_a_finite_explosion():
    """A loss that explodes but stays finite (lr too high with clipping: 3 nats to 15) used to run
    on to the end. Now: --explode-factor (4) x the running median of the healthy losses, 1 nat
    above it, 3 steps in a row stop in one line saying what to do; one spike does not, nor the
    first steps (warm-up), a low loss's noise (0.02 -> 0.5 nats) or --explode-factor 0; a
    resumed run's watch is seeded with the losses before its checkpoint."""
    rng = np.random.default_rng(0)
    calm = list(3.0 + 0.1 * rng.standard_normal(train.EXPLODE_WARMUP + 2))
    w = train.DivergenceWatch(skip_limit=3, lr=0.1)
    w.observe(1, 50.0, 1.0, False)  # before the warm-up: no median yet
    for i, loss in enumerate(calm, 2):
        w.observe(i, loss, 1.0, False)
    i = len(calm) + 2
    w.observe(i, 15.0, 1.0, False)  # one spike
    assert w.suspect and w.kind == "exploding"
    w.observe(i + 1, 3.0, 1.0, False)
    assert not w.suspect
    w.observe(i + 2, 14.0, 1.0, False)
    w.observe(i + 3, 16.0, 1.0, False)
    with pytest.raises(train.Diverged) as e:
        w.observe(i + 4, 15.0, 1.0, False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"the loss exploded: steps {i + 2}-{i + 4} had losses above 4 x the median")
    assert "lower --lr (now 0.1)" in msg and "--explode-factor 0" in msg
    assert e.value.record["why"] == "exploded" and e.value.record["since_step"] == i + 2
    off = train.DivergenceWatch(skip_limit=3, lr=0.1, explode_factor=0)
    low = train.DivergenceWatch(skip_limit=3, lr=0.1)
    for k, loss in enumerate(calm + [15.0] * 5, 1):
        off.observe(k, loss, 1.0, False)
    for k, loss in enumerate([0.02] * 12 + [0.5] * 5, 1):
        low.observe(k, loss, 1.0, False)
    assert not low.suspect
    resumed = train.DivergenceWatch(skip_limit=3, lr=0.1)
    resumed.seed([None, *calm])
    resumed.observe(1, 15.0, 1.0, False)
    resumed.observe(2, 15.0, 1.0, False)
    with pytest.raises(train.Diverged, match="the loss exploded: steps 1-3"):
        resumed.observe(3, 15.0, 1.0, False)
    for bad in (0.5, 1.0, -2.0):
        with pytest.raises(train.UsageError, match="--explode-factor must be > 1"):
            train._validate(dataclasses.replace(train.preset_config(), explode_factor=bad))


def test_diverged_finetune_stops_and_keeps_the_good_checkpoint(tmp_path, capsys):
    """A fresh user's fine-tune at --lr 1e4 --clip 0 ended with exit 0: the loss stayed finite
    (log V: the hidden states overflow, RMSNorm's mean square is inf, every normalised state 0)
    with a gradient norm of 0 from then on. Now: one line, exit 2, the checkpoint of the dead
    state deleted, the one before it kept intact, and report.json saying why it stopped.
    (--warmup 4: step 1 runs at lr 0, so checkpoint 1 is the pre-trained model.)"""
    import json

    import numpy as np

    from chunkjax import checkpoint as ck
    words = "the sea of troubles arms fortune slings and arrows outrageous mind to be or not question".split()
    rng = np.random.default_rng(0)
    (tmp_path / "t.txt").write_text("\n\n".join(" ".join(rng.choice(words, 30)) for _ in range(40)))
    out = tmp_path / "runs"
    rc = train.main(["--init-from", str(ROOT / "tests" / "fixtures" / "hf_llama3"), "--data", str(tmp_path / "t.txt"),
                     "--steps", "6", "--batch", "2", "--seq", "32", "--eval-every", "6", "--eval-batches", "1",
                     "--sample-tokens", "0", "--lr", "1e4", "--clip", "0", "--warmup", "4", "--no-progress",
                     "--checkpoint-every", "1", "--keep-checkpoints", "5", "--export", "none", "--out-dir", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and err.startswith("error: the model diverged: steps 4-6 had a gradient norm of 0"), err
    assert "checkpoint step 3 of the diverged model deleted" in err and "keeps checkpoint step 2" in err, err
    (run,) = out.iterdir()
    assert run.name.endswith(".partial")
    rep = json.loads((run / "report.json").read_text())
    assert rep["stopped"]["why"] == "dead" and rep["stopped"]["step"] == 6 and rep["stopped"]["since_step"] == 4
    assert rep["stopped"]["checkpoints_kept"] == [1, 2] and rep["stopped"]["checkpoints_dropped"] == [3]
    assert rep["config"]["lr"] == 1e4
    assert ck.all_steps(run / "checkpoints") == [1, 2] and ck.latest_step(run / "checkpoints") == 2  # intact
    assert sorted(os.listdir(run / "checkpoints")) == ["step_00000001", "step_00000002"]  # no temporaries
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4, 5]  # the step that stopped it is in the report, not the metrics


def test_schedule_note_when_the_warmup_outlasts_the_horizon():
    """--steps 20 with the default --warmup 30 (fresh19): host_spec stretches the cosine to warmup + 1
    steps, so the whole run warms up; the job says so in one line, and the note's lr factor is the
    schedule's own at the horizon's last step."""
    cfg = dataclasses.replace(train.TrainConfig(), steps=20, warmup=30, lr_decay_steps=0)
    note = train.schedule_note(cfg)
    assert note.startswith("note: --warmup 30 >= --steps 20") and "\n" not in note
    lr_last = float(train.host_spec(cfg).learning_rate(19))  # step 20 runs at count 19
    assert f"({lr_last / cfg.lr:.2g} x --lr)" in note, (note, lr_last)
    assert lr_last < cfg.lr  # the run never reached its peak: the note is true
    assert "--lr-decay-steps 20" in train.schedule_note(dataclasses.replace(cfg, steps=40, lr_decay_steps=20))
    for quiet in (dataclasses.replace(cfg, steps=400), dataclasses.replace(cfg, warmup=0)):
        assert train.schedule_note(quiet) == ""


def test_default_warmup_fits_the_run(monkeypatch):
    """--warmup defaulted to 30 steps whatever the run's length, so a short run (--steps 20) spent
    all of it below --lr (ux20). The default (-1) is now min(30, a tenth of the cosine's horizon),
    the run's own on --resume; values given are kept, and --help says what it is."""
    base = train.TrainConfig()
    assert base.warmup == -1 and train.parse_args([]).warmup == -1 and train.parse_args(["--warmup", "30"]).warmup == 30
    auto = {steps: train.warmup_for(dataclasses.replace(base, steps=steps)) for steps in (400, 1000, 20, 9, 1)}
    assert auto == {400: 30, 1000: 30, 20: 2, 9: 0, 1: 0}
    assert train.warmup_for(dataclasses.replace(base, steps=20, lr_decay_steps=200)) == 20  # the horizon's tenth
    for given in (0, 3, 30, 50):
        assert train.warmup_for(dataclasses.replace(base, steps=20, warmup=given)) == given
    rp = lambda saved: train.ResumePoint("r", "r/checkpoints", 5, {"extra": {"config": saved}})  # noqa: E731
    assert train.warmup_for(dataclasses.replace(base, steps=80), rp({"warmup": 7, "steps": 20})) == 7
    assert train.warmup_for(dataclasses.replace(base, steps=80), rp({"steps": 20})) == 30  # before the setting: 30
    # the 20-step run now warms up in 2 steps and decays: peak lr at step 3, lr/10 at the horizon, no note
    short = dataclasses.replace(base, steps=20, lr_decay_steps=0)
    lr = train.host_spec(short).learning_rate
    assert float(lr(0)) == 0.0 and float(lr(2)) == pytest.approx(short.lr) and float(lr(20)) == pytest.approx(short.lr / 10)
    assert train.schedule_note(short) == ""
    with pytest.raises(train.UsageError, match=r"^--warmup must be >= 0 .* got -2$"):
        train._validate(dataclasses.replace(base, warmup=-2))
    monkeypatch.setenv("COLUMNS", "400")
    assert "-1: min(30, a tenth of the cosine's horizon --lr-decay-steps or --steps" in _help([])


def test_config_line_spells_out_the_sentinels():
    """The config line printed checkpoint_every=-1 (ux20): it now says what -1 and 0 mean, and
    marks an automatic --warmup; every other setting as resolved."""
    resolved = dataclasses.asdict(dataclasses.replace(train.TrainConfig(), warmup=2, eval_every=50))
    line = train.config_line(resolved, warmup_given=False)
    assert line.startswith("config: model=tiny ") and "\n" not in line
    assert " checkpoint_every=each_eval(50) " in line and " warmup=2(auto) " in line and " eval_every=50 " in line
    assert " checkpoint_every=off " in train.config_line(resolved | {"checkpoint_every": 0})
    given = train.config_line(resolved | {"checkpoint_every": 7})
    assert " checkpoint_every=7 " in given and " warmup=2 " in given
    assert resolved["checkpoint_every"] == -1  # the report's config keeps the value itself
