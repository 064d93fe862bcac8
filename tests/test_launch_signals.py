"""Signals as the process was launched: a user's background training job ignored a real SIGINT for
~3,000 steps, and session 20's ``make test`` failed the three tests that raise SIGINT (in process,
or in a child). Both had one cause: a non-interactive shell starts a background job (``cmd &`` in a
script; a helper's or CI runner's ``make test &``) with SIGINT and SIGQUIT ignored (POSIX), an
ignored signal stays ignored across ``exec`` and in every child (``subprocess``'s
``restore_signals`` resets SIGPIPE and SIGXFSZ only), and Python installs its KeyboardInterrupt
handler only where SIGINT was not ignored. Here each scenario is launched that way and must
still do what it does launched from a terminal: the tests do not depend on how the suite was
started, and the main job says what it ignores and stops cleanly on SIGTERM."""
import ast
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
#: a background job of a non-interactive shell (job control off), its exit status passed on
BACKGROUND = ["sh", "-c", '"$@" & wait $!', "sh"]
#: nohup's disposition (SIGHUP ignored), in a background job as ``nohup cmd &`` in a script
NOHUP_BACKGROUND = ["sh", "-c", 'trap "" HUP; "$@" & wait $!', "sh"]
#: a foreground command (SIGINT as this process has it: Python's default for the test's duration)
FOREGROUND = ["sh", "-c", 'exec "$@"', "sh"]
SHOW = ("import json, signal; h = signal.getsignal(signal.SIGINT); print(json.dumps(dict(ignored=h is signal.SIG_IGN, "
        "python=h is signal.default_int_handler, **{l.split(':')[0]: int(l.split()[1], 16) for l in open('/proc/self/status') "
        "if l.startswith(('SigBlk', 'SigIgn'))})))")


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]))


def test_a_background_job_of_a_script_ignores_sigint_and_its_children_inherit_it(default_sigint):
    """The premise of every test below: ``cmd &`` in ``sh -c`` ignores SIGINT (SIG_IGN, signal 2's bit in
    SigIgn) in the job and in the job's own subprocess; nothing blocks it (SigBlk 0); a foreground
    command gets Python's handler."""
    nested = f"import subprocess, sys; {SHOW}; sys.stdout.flush(); subprocess.run([sys.executable, '-c', {SHOW!r}])"
    out = subprocess.run([*BACKGROUND, sys.executable, "-c", nested], capture_output=True, text=True,
                         timeout=60, check=True).stdout.splitlines()
    assert len(out) == 2, out
    for line in map(json.loads, out):  # the job, then its subprocess
        assert line["ignored"] and line["SigIgn"] & (1 << (signal.SIGINT - 1)) and line["SigBlk"] == 0, line
    fg = subprocess.run([*FOREGROUND, sys.executable, "-c", SHOW], capture_output=True, text=True, timeout=60,
                        check=True).stdout
    assert json.loads(fg)["python"], fg


def test_default_sigint_gives_a_keyboard_interrupt_in_a_suite_started_in_the_background(tmp_path):
    """Session 20's in-process failures: a pytest session started as a background job runs a test
    that raises SIGINT; with tests/conftest.py's ``default_sigint`` it gets its KeyboardInterrupt,
    without it the SIGINT is ignored (what failed there: "DID NOT RAISE")."""
    (tmp_path / "test_ctrl_c.py").write_text(textwrap.dedent("""
        import signal
        import pytest

        def test_launched_ignoring_sigint():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN

        def test_ctrl_c_with_the_fixture(default_sigint):
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

        def test_after_it_the_launch_disposition_is_back():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)  # ignored: the test goes on

        def test_ctrl_c_without_the_fixture_is_ignored():
            with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
                with pytest.raises(KeyboardInterrupt):
                    signal.raise_signal(signal.SIGINT)
    """))
    res = subprocess.run([*BACKGROUND, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                          "no:xdist", "-p", "conftest", "--rootdir", str(tmp_path), str(tmp_path / "test_ctrl_c.py")],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "4 passed" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_sigterm_ends_a_session_with_its_temp_folders_removed(tmp_path):
    """SIGTERM to a pytest session (``kill``, ``timeout``, a CI runner's stop) ends it as Ctrl-C
    does (exit status 2), and the folders tests/conftest.py made in the temp folder (the XLA
    cache, the shared set-ups) are removed (session 26: a run so stopped left them in /tmp)."""
    (tmp_path / "test_term.py").write_text(textwrap.dedent("""
        import json, os, signal, time

        def test_terminated():
            made = [os.environ["JAX_COMPILATION_CACHE_DIR"], os.environ["CHUNKJAX_TEST_SHARED_DIR"]]
            with open("made.json", "w") as f:
                json.dump([m for m in made if os.path.isdir(m)], f)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)
    """))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in _env().items() if k not in ("JAX_COMPILATION_CACHE_DIR", "CHUNKJAX_TEST_SHARED_DIR")}
    env["TMPDIR"] = str(tmp)  # the session's folders: made by its conftest, here
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p",
                          "conftest", "--rootdir", str(tmp_path), str(tmp_path / "test_term.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    made = json.loads((tmp_path / "made.json").read_text())
    assert len(made) == 2 and all(m.startswith(str(tmp)) for m in made), made
    assert res.returncode == 2 and "terminated by SIGTERM" in res.stdout, (res.returncode, res.stdout[-3000:])
    assert [m for m in made if os.path.exists(m)] == []


JOB = """
import os, signal, sys, time
from experiments import train

def job():
    print(train.interrupt_note(), flush=True)
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        os.kill(os.getpid(), sig)
        time.sleep(0.2)  # a handled signal raises here
        print("went on after", sig.name, flush=True)

sys.exit(train.run_guarded(job))
"""


@pytest.mark.parametrize("launch, rc, went_on, last", [
    (FOREGROUND, 130, [], "interrupted: the partial run folder was removed"),
    (BACKGROUND, 143, ["SIGINT"], "terminated by SIGHUP: the partial run folder was removed"),
    (NOHUP_BACKGROUND, 143, ["SIGINT", "SIGHUP"], "terminated by SIGTERM: the partial run folder was removed"),
], ids=["foreground", "background", "nohup-background"])
def test_main_job_signals_as_launched(default_sigint, launch, rc, went_on, last):
    """The main job (:func:`experiments.train.run_guarded`) sent SIGINT, SIGHUP, SIGTERM in turn:
    Ctrl-C stops it from a terminal and is ignored, with a note that names the pid and SIGTERM,
    in a background job of a script (the shell's choice, left as Python leaves it); SIGHUP stops
    it unless it was started ignoring it (``nohup``, which the job used to undo: a closed terminal
    stopped a nohup run); SIGTERM stops it however it was started. Every stop unwinds (exit
    130/143 and the job's one line), which is what keeps or removes the run folder."""
    # the launcher starts with SIGHUP as a terminal's shell has it (default), even when this test session was
    # itself started under nohup (SIGHUP ignored, inherited across exec: session 23's clean-clone run)
    res = subprocess.run([*launch, sys.executable, "-c", JOB], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=120, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    out, err = res.stdout.splitlines(), res.stderr.strip().splitlines()
    assert res.returncode == rc and err == [last], (res.returncode, res.stdout, res.stderr[-3000:])
    if launch is FOREGROUND:
        assert out == ["None"], out
    else:
        pid = out[0].split("(pid ")[1].split(")")[0]
        assert out[0].startswith("note: SIGINT (Ctrl-C, kill -INT) is ignored") and out[0].endswith(f"kill {pid}"), out
        assert out[1:] == [f"went on after {s}" for s in went_on], out


def _sigint_uses(tree: ast.AST) -> int:
    return sum(isinstance(n, ast.Attribute) and n.attr == "SIGINT" for n in ast.walk(tree))


def _sets_sigint(tree: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "signal"
               and n.args and isinstance(n.args[0], ast.Attribute) and n.args[0].attr == "SIGINT"
               for n in ast.walk(tree))


def test_every_test_that_raises_sigint_sets_its_handler():
    """The whole kind, for tests written later: in tests/, a test function whose code names SIGINT
    asks for ``default_sigint``; any other code that names SIGINT (a worker script that sends it to
    itself, a fixture) is in a file that sets SIGINT's handler itself. Docstrings do not count."""
    unguarded, found = [], 0
    for path in sorted(TESTS.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        rest = _sigint_uses(tree)
        for fn in tree.body:
            if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_") and (n := _sigint_uses(fn)):
                rest -= n
                found += 1
                if "default_sigint" not in [a.arg for a in fn.args.args] and not _sets_sigint(fn):
                    unguarded.append(f"{path.name}::{fn.name}")
        if rest and not _sets_sigint(tree):
            unguarded.append(f"{path.name} (outside a test function)")
    assert found >= 2 and not unguarded, f"these raise SIGINT whatever the launch ignored: {unguarded}"


STORAGE_TRAINER = """
import os, sys
import numpy as np, optax
from chunkjax.host_update import AdamW
from chunkjax.storage.near import NearStorageOptimizer
sizes = [1000, 513]
opt = NearStorageOptimizer([os.path.join(sys.argv[1], "d0"), os.path.join(sys.argv[1], "d1")], sizes,
                           AdamW(optax.constant_schedule(1e-2)), init_params=[np.ones(n, np.float32) for n in sizes],
                           _fault=dict(worker=1, step=1, after_chunks=1, marker=sys.argv[2], sleep_s=120))
try:
    opt.step([np.full(n, 0.1, np.float32) for n in sizes])
except KeyboardInterrupt:
    print("trainer: KeyboardInterrupt", flush=True)
print("workers:", [(w.join(30), w.exitcode)[1] for w in opt.workers], flush=True)
opt.close()
print("committed step", opt.committed_step, flush=True)
"""


def test_ctrl_c_at_a_terminal_stops_the_storage_workers_quietly(tmp_path, default_sigint):
    """A Ctrl-C at a terminal reaches the whole foreground process group: the trainer and its
    near-storage workers (multiprocessing children), one of them mid-step. The trainer gets its
    KeyboardInterrupt; each worker exits with 130 and no traceback (each printed a KeyboardInterrupt
    traceback before); the step is not committed."""
    import time
    marker = tmp_path / "worker1_in_step1"
    proc = subprocess.Popen([sys.executable, "-c", STORAGE_TRAINER, str(tmp_path), str(marker)], cwd=ROOT, env=_env(),
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while not marker.exists() and proc.poll() is None and time.monotonic() - t0 < 120:
            time.sleep(0.05)
        assert marker.exists(), proc.communicate(timeout=60)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0 and out.splitlines() == ["trainer: KeyboardInterrupt", "workers: [130, 130]",
                                                          "committed step 0"], (out, err[-3000:])
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]


def test_release_holds_closes_an_abandoned_hold_and_delivers_what_arrived(default_sigint):
    """A hold left open (a pending step dropped uncommitted) keeps SIGINT from its handler;
    ``release_holds`` closes it, delivers the held SIGINT once (KeyboardInterrupt), and the dropped
    hold's own late release then does nothing (no count below zero)."""
    import signal

    import pytest
    from chunkjax.step_commit import SignalHold, open_holds, release_holds
    assert open_holds() == 0
    hold = SignalHold()
    hold.start()
    assert open_holds() == 1
    signal.raise_signal(signal.SIGINT)  # held: nothing raised here
    with pytest.raises(KeyboardInterrupt):
        release_holds()
    assert open_holds() == 0 and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    hold.release()
    assert open_holds() == 0
    assert release_holds() == 0
