"""What a fresh user found wrong in the fine-tuning tool (experiments/train.py), each fixed for
its kind: byte counts printed in GiB whatever their size, ``--help`` showing the random-init
defaults under ``--init-from``, ``--storage`` directories checked only when the plan used them,
and a diverged run ending with exit 0. (The tied/untied head of a Hugging Face folder:
tests/test_hf.py.)"""
import contextlib
import io
import os
import pathlib

import pytest

from chunkjax.errors import format_bytes
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
