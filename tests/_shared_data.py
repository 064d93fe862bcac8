"""Token data shared by the tests that only read it: the bpe512 cache (training the small BPE and
tokenizing the plays takes ~10 s on the CI machine) is built once per pytest process, in a
temporary folder removed at exit. tests/test_data.py checks that build (and builds its gpt2 cache).
The SmolLM2-135M weights (reading the GGUF takes ~10 s) are loaded once per pytest process too."""
import atexit
import functools
import shutil
import tempfile


@functools.lru_cache(maxsize=None)
def bpe512_build():
    """``(folder, token data)``: the folder of a complete ``load_token_data("bpe512", ...)`` cache
    (read-only for tests) and what that call returned when it built the folder from the documents
    (``meta["cached"]`` false), for tests/test_data.py to check the building on."""
    from experiments import data as data_mod
    d = tempfile.mkdtemp(prefix="chunkjax_test_bpe512_")
    atexit.register(shutil.rmtree, d, True)
    return d, data_mod.load_token_data("bpe512", d)


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
