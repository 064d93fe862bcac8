"""Corrupted and incomplete checkpoints (issue 21, item 2): every file a save writes has its size
and crc32 in ``checksums.json``; 16 bytes flipped in any kind of file (orbax's data files, its
metadata, our meta.json, the checksums themselves) or a truncated meta.json give one line
naming the file on restore, and ``latest_step`` and the main job's resume path
(``experiments/train.py:find_resume_point``) fall back to the checkpoint before it with a
warning. And a peer lost during a 2-process save (issue 21, item 6): one line naming it, no
temporary left, the previous checkpoint intact."""
import os
import re
import shutil
import sys
import warnings

import numpy as np
import pytest

from chunkjax import checkpoint as ck

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_checkpoint as tc  # noqa: E402

STEPS = (1, 2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A ChunkedStep with device- and host-updated chunks, checkpoints of steps 1 and 2 (step 2
    is the one the tests break), written with the main job's ``extra``."""
    setup = tc.build_setup()
    step = tc.make_step(setup, [0, 1])
    state = step.init(setup[1])
    d = tmp_path_factory.mktemp("intact")
    for s in STEPS:
        state, _ = tc.run(step, state, setup[2][s - 1:s])
        ck.save_checkpoint(d, s, step, state, {"data_position": s, "config": {"model": "micro", "steps": 6}})
    return step, d, state


def _kind(rel: str) -> str:
    """A file's kind: its path in the chunk with hash names replaced (``ocdbt.process_0/d/<hash>``)."""
    rel = re.sub(r"^chunk_\d{5}/", "", rel)
    return re.sub(r"[0-9a-f]{32}", "<hash>", rel)


def _files_by_kind(root) -> dict[str, str]:
    """One file per kind (the largest), relative to ``root``."""
    out: dict[str, tuple[int, str]] = {}
    for d, _, files in os.walk(root):
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), root)
            size = os.path.getsize(os.path.join(root, rel))
            k = _kind(rel)
            if k not in out or size > out[k][0]:
                out[k] = (size, rel)
    return {k: rel for k, (_, rel) in out.items()}


def _copy(saved, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(saved[1], d)
    return d


def _flip(path, n=16):
    b = bytearray(path.read_bytes())
    at = len(b) // 2
    for i in range(at, min(at + n, len(b))):
        b[i] ^= 0xFF
    path.write_bytes(bytes(b))


def _assert_one_line_naming(err, path):
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg, msg


KINDS = ["meta.json", "checksums.json", "_METADATA", "_CHECKPOINT_METADATA", "commit_success.txt", "manifest.ocdbt",
         "d/<hash>", "ocdbt.process_0/manifest.ocdbt", "ocdbt.process_0/d/<hash>"]


def test_every_file_kind_is_covered(saved):
    """The kinds below are all the kinds a save writes (a new orbax file kind fails here)."""
    assert sorted(_files_by_kind(saved[1] / "step_00000002")) == sorted(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_flipped_bytes_in_each_file_kind_refused(saved, tmp_path, kind):
    step, _, _ = saved
    d = _copy(saved, tmp_path)
    root = d / "step_00000002"
    bad = root / _files_by_kind(root)[kind]
    _flip(bad)
    with pytest.raises(ck.CheckpointError) as err:
        ck.restore_checkpoint(d, step, 2)
    _assert_one_line_naming(err, bad)
    with pytest.raises(ck.CheckpointError) as err:
        ck.verify_checkpoint(d, 2)
    _assert_one_line_naming(err, bad)
    with pytest.warns(RuntimeWarning, match=re.escape(str(bad))):
        assert ck.latest_step(d) == 1
    with pytest.warns(RuntimeWarning, match="step 2 skipped"):
        restored, extra = ck.restore_checkpoint(d, step)  # the latest intact one: step 1
    assert extra["data_position"] == 1
    ref, _ = ck.restore_checkpoint(saved[1], step, 1)
    tc.assert_trees(ck.export_params(step, restored), ck.export_params(step, ref))


@pytest.mark.parametrize("kind", ["ocdbt.process_0/d/<hash>", "meta.json", "checksums.json"])
def test_only_checkpoint_corrupt_is_one_line_naming_the_file(saved, tmp_path, kind):
    """With one step saved and a byte flipped in it, restoring the latest checkpoint is a
    CheckpointError naming the file (with its crc32, for data files) and saying no earlier step
    exists, not 'no complete checkpoint' (FileNotFoundError)."""
    step, _, _ = saved
    d = _copy(saved, tmp_path)
    shutil.rmtree(d / "step_00000001")
    root = d / "step_00000002"
    bad = root / _files_by_kind(root)[kind]
    _flip(bad)
    for call in (lambda: ck.restore_checkpoint(d, step), lambda: ck.read_meta(d)):
        with warnings.catch_warnings(record=True) as seen, \
                pytest.raises(ck.CheckpointError, match="no earlier checkpoint") as err:
            warnings.simplefilter("always")
            call()
        assert not seen, [str(w.message) for w in seen]  # the one line alone, no "using an earlier step" first (fresh25)
        _assert_one_line_naming(err, bad)
        if kind.startswith("ocdbt"):
            assert "crc32" in str(err.value)


def test_fallback_warning_names_the_step_restored_instead(saved, tmp_path):
    """A corrupt newest checkpoint with an earlier one: the restore falls back, and its one warning
    names the skipped step, its bad file and the step restored instead, without advising to
    restore an earlier step explicitly, which it already did (fresh25)."""
    step, _, _ = saved
    d = _copy(saved, tmp_path)
    root = d / "step_00000002"
    bad = root / _files_by_kind(root)["ocdbt.process_0/d/<hash>"]
    _flip(bad)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _, extra = ck.restore_checkpoint(d, step)
    assert extra["data_position"] == 1
    msgs = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "\n" not in msgs[0], msgs
    assert msgs[0].startswith("checkpoint step 2 skipped: ") and str(bad) in msgs[0] and "crc32" in msgs[0], msgs
    assert msgs[0].endswith("; using step 1 instead"), msgs
    assert "step_number" not in msgs[0] and "explicitly" not in msgs[0], msgs


def test_corrupt_step_names_how_to_restore_an_earlier_one(saved, tmp_path):
    """A corrupt step restored explicitly: the line names the file, its crc32 and the call that
    restores the earlier step; that explicit call works."""
    step, _, _ = saved
    d = _copy(saved, tmp_path)
    root = d / "step_00000002"
    bad = root / _files_by_kind(root)["ocdbt.process_0/d/<hash>"]
    _flip(bad)
    with pytest.raises(ck.CheckpointError, match=r"crc32 .*step_number=1\) \(complete earlier steps: \[1\]\)") as err:
        ck.restore_checkpoint(d, step, 2)
    _assert_one_line_naming(err, bad)
    _, extra = ck.restore_checkpoint(d, step, step_number=1)
    assert extra["data_position"] == 1


def test_truncated_meta_json(saved, tmp_path):
    step, _, _ = saved
    d = _copy(saved, tmp_path)
    meta = d / "step_00000002" / ck.META
    meta.write_bytes(meta.read_bytes()[:100])
    for call in (lambda: ck.read_meta(d, 2), lambda: ck.restore_checkpoint(d, step, 2)):
        with pytest.raises(ck.CheckpointError) as err:
            call()
        _assert_one_line_naming(err, meta)
    with pytest.warns(RuntimeWarning, match="step 2"):
        assert ck.latest_step(d) == 1
    with pytest.warns(RuntimeWarning, match="step 2"):
        assert ck.read_meta(d)["step"] == 1


def test_truncated_meta_json_without_checksums(saved, tmp_path):
    """Even with checksums.json gone too, an unreadable meta.json is one line naming it."""
    d = _copy(saved, tmp_path)
    root = d / "step_00000002"
    (root / ck.CHECKSUMS).unlink()
    (root / ck.META).write_text('{"format": "chunkjax-checkpoint", "vers')
    with pytest.raises(ck.CheckpointError) as err:
        ck.read_meta(d, 2)
    _assert_one_line_naming(err, root / ck.META)


def test_missing_files_are_incomplete(saved, tmp_path):
    """A newest checkpoint without its checksums, a data file or its meta.json is skipped."""
    d = _copy(saved, tmp_path)
    root = d / "step_00000002"
    (root / ck.CHECKSUMS).unlink()
    with pytest.warns(RuntimeWarning, match=re.escape(str(root / ck.CHECKSUMS))):
        assert ck.latest_step(d) == 1
    d = _copy(saved, tmp_path / "b")
    root = d / "step_00000002"
    gone = root / _files_by_kind(root)["ocdbt.process_0/d/<hash>"]
    gone.unlink()
    with pytest.raises(ck.CheckpointError) as err:
        ck.restore_checkpoint(d, saved[0], 2)
    _assert_one_line_naming(err, gone)
    (root / ck.META).unlink()
    with pytest.warns(RuntimeWarning, match="incomplete"):
        assert ck.latest_step(d) == 1
    assert ck.all_steps(d) == [1]


def test_resume_falls_back_to_the_previous_checkpoint(saved, tmp_path):
    """The main job's --resume finds the newest intact checkpoint (train.py is unchanged: it
    calls latest_step and read_meta)."""
    from experiments import train
    run = tmp_path / "micro_run.partial"
    shutil.copytree(saved[1], run / train.CHECKPOINT_DIR)
    (run / "metrics.jsonl").write_text("")
    assert train.find_resume_point(str(run)).step == 2
    root = run / train.CHECKPOINT_DIR / "step_00000002"
    bad = root / _files_by_kind(root)["ocdbt.process_0/d/<hash>"]
    _flip(bad)
    with pytest.warns(RuntimeWarning, match=re.escape(str(bad))):
        rp = train.find_resume_point(str(run))
    assert rp.step == 1 and rp.meta["extra"]["data_position"] == 1


def test_resume_of_a_library_checkpoint_says_how_to_load_it(saved, tmp_path):
    """--resume given a folder chunkjax.save_checkpoint wrote (no job settings in its extra): one
    line saying it is not the job's and how such a checkpoint is loaded (fresh25)."""
    from experiments import train
    step, _, state = saved
    ck.save_checkpoint(tmp_path / "mine", 3, step, state, {"note": "mine"})
    with pytest.raises(train.UsageError) as err:
        train.find_resume_point(str(tmp_path / "mine"))
    msg = str(err.value)
    assert "\n" not in msg and "was not written by experiments.train" in msg, msg
    assert "chunkjax.restore_checkpoint(" in msg and "run folder" in msg, msg


def test_checksums_cost_little(saved, tmp_path):
    """Checksumming (crc32 of every file, read back from the page cache) is a small part of a
    save: measured here on the save's own files."""
    import time
    step, _, state = saved
    t = time.perf_counter()
    path = ck.save_checkpoint(tmp_path, 3, step, state, {})
    save_s = time.perf_counter() - t
    t = time.perf_counter()
    sums = ck.files.tree_checksums(path, "")
    crc_s = time.perf_counter() - t
    assert set(sums) == set(ck.files.read_checksums(path)) | {ck.CHECKSUMS}
    assert crc_s < 0.1 * save_s, (crc_s, save_s)  # observed: 0.005 s of 0.8 s


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_peer_lost_during_two_process_save(tmp_path, how):
    """2 processes (jax.distributed, 4 CPU devices each) save a ZeRO-3 state; during the second
    save process 1 is SIGKILLed (its gather fails in Gloo) or SIGSTOPped (the gather would wait
    forever; deadline 3 s). Process 0 raises one line naming process 1, removes its temporary
    directory, and checkpoint 1 stays intact and restorable here in one process."""
    import socket
    import subprocess

    import jax

    from chunkjax.topology import build_zero_layout
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import zero_multiprocess_worker as zmw
    seed, ckpt, out = 0, tmp_path / "ckpt", tmp_path / "out.npz"
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    from _multiprocess import cpu_env
    env = cpu_env(4)
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint_lost_peer_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, str(i), "2", str(port), str(seed), str(ckpt), str(out), how],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        log0 = procs[0].communicate(timeout=240)[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        log1 = procs[1].communicate()[0]
    assert procs[0].returncode == 0, log0[-3000:] + log1[-3000:]
    lost = [line for line in log0.splitlines() if line.startswith("LOST: ")]
    assert len(lost) == 1 and "process 1 of 2 lost while gathering chunk 1" in lost[0], log0[-3000:]
    assert "existing checkpoints are intact (latest: step 1)" in lost[0]
    assert sorted(os.listdir(ckpt)) == ["step_00000001"]  # no temporary left
    ck.verify_checkpoint(ckpt, 1)
    cfg, params, _, _ = zmw.draw(seed)
    layout = build_zero_layout(params, 8, cfg.vocab_size * cfg.d_model)
    got, ref = np.load(out), ck.export_checkpoint_params(ckpt, layout)
    for i, a in enumerate(jax.tree.leaves(ref)):
        np.testing.assert_array_equal(a, got[f"p{i}"])


def test_saving_over_a_broken_step_sets_it_aside(saved, tmp_path):
    """A fresh user's resumed run (session 24): the restore skipped the corrupt newest checkpoint
    (step 2) and resumed from step 1, and the run's next save of step 2 stopped with
    FileExistsError on the corrupt directory. Right: the save moves a corrupt or incomplete
    directory aside (``step_00000002.broken``, then ``.broken.1``; its files kept byte for byte,
    a warning naming both) and writes the step, which restores to the saved state bit for bit;
    an intact checkpoint is still never overwritten."""
    step, _, state = saved
    d = _copy(saved, tmp_path)
    root = d / "step_00000002"
    rel = _files_by_kind(root)["ocdbt.process_0/d/<hash>"]
    _flip(root / rel)
    kept = (root / rel).read_bytes()
    with pytest.warns(RuntimeWarning, match="skipped"):
        assert ck.latest_step(d) == 1
    with pytest.warns(RuntimeWarning, match=r"is corrupt .* moved to .*step_00000002\.broken"):
        ck.save_checkpoint(d, 2, step, state, {"data_position": 2})
    assert (d / "step_00000002.broken" / rel).read_bytes() == kept
    assert ck.all_steps(d) == [1, 2] and ck.latest_step(d) == 2  # verified: the new one is intact
    restored, extra = ck.restore_checkpoint(d, step)
    assert extra["data_position"] == 2
    tc.assert_trees(ck.export_params(step, restored), ck.export_params(step, state))
    with pytest.raises(FileExistsError, match="already exists"):  # intact: refused, untouched
        ck.save_checkpoint(d, 2, step, state)
    os.remove(d / "step_00000002" / "meta.json")  # incomplete
    with pytest.warns(RuntimeWarning, match=r"incomplete .* moved to .*step_00000002\.broken\.1"):
        ck.save_checkpoint(d, 2, step, state, {"data_position": 2})
    assert ck.latest_step(d) == 2 and sorted(p.name for p in d.iterdir() if p.name.startswith("step_")) == [
        "step_00000001", "step_00000002", "step_00000002.broken", "step_00000002.broken.1"]
