"""Token data shared by the tests that only read it: the bpe512 cache (training the small BPE and
tokenizing the plays: ~18 s of CPU time) is built once per pytest session, in the
session's folder (``CHUNKJAX_TEST_SHARED_DIR``, made by tests/conftest.py and inherited by the
xdist workers, removed when the session ends), by whichever process asks first while the others
wait; without that folder, once per process in a temporary folder removed at exit.
tests/test_data.py checks that build (and builds its gpt2 cache). The SmolLM2-135M weights
(reading the GGUF takes ~10 s) are loaded once per pytest process. The main job's tests train
``--model micro`` with 2 blocks instead of 4 (:func:`two_block_micro`)."""
import atexit
import contextlib
import dataclasses
import functools
import os
import pickle
import shutil
import tempfile


@functools.lru_cache(maxsize=None)
def bpe512_build():
    """``(folder, token data)``: the folder of a complete ``load_token_data("bpe512", ...)`` cache
    (read-only for tests) and what that call returned when it built the folder from the documents
    (``meta["cached"]`` false), for tests/test_data.py to check the building on.

    The building process records the call's result (its train/val ids, vocabulary size and meta)
    beside the folder; a process that finds the folder built gets that record, with the tokenizer
    read back from the folder (a tokenizer holds closures: it does not pickle)."""
    from experiments import data as data_mod
    shared = os.environ.get("CHUNKJAX_TEST_SHARED_DIR")
    if not shared:
        d = tempfile.mkdtemp(prefix="chunkjax_test_bpe512_")
        atexit.register(shutil.rmtree, d, True)
        return d, data_mod.load_token_data("bpe512", d)
    import fcntl
    d, record = os.path.join(shared, "bpe512"), os.path.join(shared, "bpe512_build.pkl")
    with open(os.path.join(shared, "bpe512.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (also if this process dies)
        if not os.path.exists(record):
            built = data_mod.load_token_data("bpe512", d)
            with open(record + ".tmp", "wb") as f:
                pickle.dump((built.train, built.val, built.vocab_size, built.meta), f)
            os.replace(record + ".tmp", record)
            return d, built
        with open(record, "rb") as f:
            train, val, vocab_size, meta = pickle.load(f)
        tokenizer = data_mod.load_token_data("bpe512", d).tokenizer
    return d, data_mod.TokenData(train, val, vocab_size, tokenizer, meta)


def bpe512_cache() -> str:
    """The folder of a complete ``load_token_data("bpe512", ...)`` cache (read-only for tests)."""
    return bpe512_build()[0]


@functools.lru_cache(maxsize=None)
def _smollm2_135m():
    from models import llama
    cfg, params, tok = llama.load_smollm2_135m()
    for a in _leaves(params):
        a.setflags(write=False)  # shared by every test that asks: nobody may write into it
    return cfg, params, tok


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    else:
        yield tree


def _copy_dicts(tree):
    return {k: _copy_dicts(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def smollm2_135m():
    """``llama.load_smollm2_135m()`` (float32), loaded once per pytest process: the config, the
    params (fresh dicts each call, over shared read-only numpy arrays) and the tokenizer."""
    cfg, params, tok = _smollm2_135m()
    return cfg, _copy_dicts(params), tok


#: blocks of ``--model micro`` in the tests that run the main job (experiments/train.py): what they
#: check (reports, checkpoints and resume, micro-batches, ZeRO, bad input) does not depend on the
#: depth; 2 blocks give smaller programs to trace and compile (about as many of them: the plan cuts
#: the step by moments, not by blocks)
JOB_MICRO_BLOCKS = 2


@contextlib.contextmanager
def two_block_micro():
    """``models.gpt``'s "micro" config with :data:`JOB_MICRO_BLOCKS` blocks while the block runs
    (restored after it): tests/test_train_job.py, tests/test_train_multiprocess.py (and the
    processes they start), the session's ZeRO-3 job run (tests/conftest.py) and
    tests/test_sweep.py train that model."""
    from models import gpt
    real = gpt.CONFIGS["micro"]
    gpt.CONFIGS["micro"] = dataclasses.replace(real, n_layers=JOB_MICRO_BLOCKS)
    try:
        yield
    finally:
        gpt.CONFIGS["micro"] = real
