"""Token data shared by the tests that only read it: the bpe512 cache (training the small BPE and
tokenizing the plays takes ~10 s on the CI machine) is built once per pytest process, in a
temporary folder removed at exit. tests/test_data.py builds its own caches: it tests the building."""
import atexit
import functools
import shutil
import tempfile


@functools.lru_cache(maxsize=None)
def bpe512_cache() -> str:
    """The folder of a complete ``load_token_data("bpe512", ...)`` cache (read-only for tests)."""
    from experiments import data as data_mod
    d = tempfile.mkdtemp(prefix="chunkjax_test_bpe512_")
    atexit.register(shutil.rmtree, d, True)
    data_mod.load_token_data("bpe512", d)
    return d
