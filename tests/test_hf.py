"""Hugging Face checkpoints of the Llama family in and out (issue 25 items 1, 2, 4, 5).

* Import: the tiny checkpoints of tests/fixtures/hf_* (written by transformers itself,
  experiments/make_hf_fixtures.py: Llama 2 (MHA, untied), Llama 3.1 (GQA, untied, llama3 rope
  scaling, bfloat16, sharded), Mistral (sliding window 4), Qwen2 (q/k/v biases, tied)) give
  transformers' float32 logits to 1e-4, with their tokenizer's ids; the feature each fixture
  carries changes the logits (so the check is not vacuous).
* Streaming: a sharded float32 checkpoint loads with host memory growing by less than twice its
  size (measured in a subprocess: VmHWM - VmRSS before the load).
* Export: import -> export writes the same files with bit-identical tensors and config; sharding
  above a size with the index file; transformers' ``safetensors`` reads our files.
* The 8B paths: the threaded transpose and bf16 widening, threaded reads and shards written by
  threads equal the plain ones bit for bit.
* Loss masks in the batch (``-1 - t``): the masked mean, the fused head equal to the plain one.
* Your own data (experiments/user_data.py): text and JSON lines, prompt/completion masks, the
  held-out split, errors.
* One job: ``--init-from <folder> --data ...`` fine-tunes, its held-out loss falls, the run folder
  holds the report, loss curve, samples and an export that re-imports.
* Live: where torch + transformers are importable (or HF_REF_PYTHON names a Python that has
  them), transformers' logits of the fixtures and of a changed export equal ours.
"""
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import data as data_mod
from experiments import train, user_data
from experiments.data import Tokenizer
from experiments.make_hf_fixtures import FAMILIES, PROMPT
from models import hf, llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
NAMES = list(FAMILIES)
#: float32 on both sides, 2 blocks: measured ~3e-6
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module")
def refs():
    return np.load(os.path.join(FIXTURES, "hf_refs.npz"))


def fixture(name):
    return os.path.join(FIXTURES, name)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_reference(name, refs):
    ck = hf.open_hf_checkpoint(fixture(name))
    cfg, params = ck.config, ck.params()
    ids = refs[f"{name}_ids"]
    assert ck.tokenizer().encode(PROMPT).ids == ids.tolist()
    logits = np.asarray(llama.forward_logits(cfg, params, jnp.asarray(ids[None])))[0]
    err = np.abs(logits - refs[f"{name}_logits"]).max()
    print(f"{name}: max |logit - transformers| = {err:.2e} (logits up to {np.abs(logits).max():.2f})")
    assert err <= LOGIT_ATOL
    # the family's feature is there, and matters
    feature = {"hf_llama2": dict(n_kv_heads=cfg.n_heads, tie_embeddings=False),
               "hf_llama3": dict(rope_type="llama3", tie_embeddings=False, n_kv_heads=1),
               "hf_mistral": dict(family="mistral", sliding_window=4),
               "hf_qwen2": dict(family="qwen2", bias_projs=("q_proj", "k_proj", "v_proj"), tie_embeddings=True)}[name]
    assert {k: getattr(cfg, k) for k in feature} == feature
    without = {"hf_llama3": dict(rope_type="default"), "hf_mistral": dict(sliding_window=None)}.get(name)
    if without:
        other = np.asarray(llama.forward_logits(llama.LlamaConfig(**{**cfg.__dict__, **without}), params,
                                                jnp.asarray(ids[None])))[0]
        assert np.abs(other - refs[f"{name}_logits"]).max() > 100 * LOGIT_ATOL
    if name == "hf_llama3":
        assert ck.dtype("lm_head.weight") == np.dtype("bfloat16") and (ck.path / hf.INDEX_FILE).is_file()


@pytest.mark.parametrize("name", NAMES)
def test_import_export_bit_identical(name, tmp_path):
    ck = hf.open_hf_checkpoint(fixture(name))
    out = hf.export_hf_checkpoint(ck.config, ck.params(), tmp_path / "out", source=ck)
    src = pathlib_files(fixture(name))
    assert pathlib_files(out) == src
    assert json.loads((out / "config.json").read_text()) == json.loads((ck.path / "config.json").read_text())
    for f in hf.TOKENIZER_FILES:
        if (ck.path / f).is_file():
            assert (out / f).read_bytes() == (ck.path / f).read_bytes()
    if (ck.path / hf.INDEX_FILE).is_file():
        a = json.loads((ck.path / hf.INDEX_FILE).read_text())
        b = json.loads((out / hf.INDEX_FILE).read_text())
        assert a["weight_map"] == b["weight_map"] and a["metadata"]["total_size"] == b["metadata"]["total_size"]
    mine, theirs = dict(hf.iter_tensors(out)), dict(hf.iter_tensors(ck.path))
    assert mine.keys() == theirs.keys()  # a tied folder's lm_head.weight too: test_tied_head_as_transformers_reads_it
    for k, a in theirs.items():
        assert mine[k].dtype == a.dtype and mine[k].shape == a.shape and mine[k].tobytes() == a.tobytes(), k
    from safetensors import safe_open  # the reference reader reads our files
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            with safe_open(str(out / f), "numpy") as fh:
                assert fh.metadata() == {"format": "pt"}
                for k in fh.keys():
                    assert fh.get_tensor(k).tobytes() == mine[k].tobytes()


def pathlib_files(d):
    return sorted(os.listdir(d))


def _head_variants(tmp_path) -> dict:
    """Copies of the tied hf_qwen2 fixture whose files also hold ``lm_head.weight``: ``copy`` (bit-
    equal to the embedding), ``differ`` (another tensor), ``only_head`` (the embedding stored only
    as lm_head.weight). name -> folder."""
    from safetensors.numpy import load_file, save_file
    rng = np.random.default_rng(5)
    emb = "model.embed_tokens.weight"

    def differ(ts):
        ts["lm_head.weight"] = (0.5 * rng.standard_normal(ts[emb].shape)).astype(ts[emb].dtype)

    edits = {"copy": lambda ts: ts.__setitem__("lm_head.weight", ts[emb].copy()), "differ": differ,
             "only_head": lambda ts: ts.__setitem__("lm_head.weight", ts.pop(emb))}
    out = {}
    for name, edit in edits.items():
        d = _broken(tmp_path, f"head_{name}", src="hf_qwen2")
        ts = load_file(str(d / "model.safetensors"))
        edit(ts)
        save_file(ts, str(d / "model.safetensors"), metadata={"format": "pt"})
        out[name] = d
    return out


def test_tied_head_as_transformers_reads_it(tmp_path, refs):
    """A tied config (tie_word_embeddings: true) whose safetensors also hold lm_head.weight lost
    that tensor on export. transformers 5 (checked: 5.24.0, PreTrainedModel.tie_weights) ties a
    bit-equal copy, does NOT tie a different lm_head.weight (warns; the head is the file's), and
    ties to lm_head.weight when the embedding is missing; live logits of these three folders
    against ours: max |diff| 1.4e-6, 4.8e-6, 1.4e-6 (test_live_transformers_matches checks them
    where torch is installed). Import reads each so, export gives back the files bit-identical,
    and an untied config without lm_head.weight is refused in one line naming the key and file."""
    ids = jnp.asarray(refs["hf_qwen2_ids"][None])
    for name, d in _head_variants(tmp_path).items():
        ck = hf.open_hf_checkpoint(d)
        logits = np.asarray(llama.forward_logits(ck.config, ck.params(), ids))[0]
        if name == "differ":  # untied: the head is the file's lm_head.weight, not the embedding
            assert not ck.config.tie_embeddings and "differs from model.embed_tokens.weight" in ck.notes[0]
            head = ck.tensor("lm_head.weight").astype(np.float32)
            assert not np.array_equal(head, ck.tensor("model.embed_tokens.weight"))
            tied = dataclasses.replace(ck.config, tie_embeddings=True)
            p = {k: v for k, v in ck.params().items() if k != "lm_head"}
            assert np.abs(np.asarray(llama.forward_logits(tied, p, ids))[0] - logits).max() > 100 * LOGIT_ATOL
            untied = jax.tree.map(np.copy, ck.params())
            untied["lm_head"]["kernel"] = np.ascontiguousarray(head.T)  # the untied reference, built by hand
            want = np.asarray(llama.forward_logits(ck.config, untied, ids))[0]
            np.testing.assert_array_equal(logits, want)
        else:  # the same model as the fixture: transformers' logits of hf_qwen2
            assert ck.config.tie_embeddings and not ck.notes
            assert np.abs(logits - refs["hf_qwen2_logits"]).max() <= LOGIT_ATOL
        out = hf.export_hf_checkpoint(ck.config, ck.params(), tmp_path / f"out_{name}", source=ck)
        assert pathlib_files(out) == pathlib_files(d)
        assert (out / "model.safetensors").read_bytes() == (d / "model.safetensors").read_bytes(), name
        assert json.loads((out / "config.json").read_text()) == json.loads((d / "config.json").read_text())
    d = _broken(tmp_path, "untied_nohead", src="hf_qwen2", edit=lambda hc: hc.update(tie_word_embeddings=False))
    with pytest.raises(ValueError) as e:
        hf.open_hf_checkpoint(d)
    assert str(e.value) == (f"{d / 'config.json'}: tie_word_embeddings is false but {d / 'model.safetensors'} has no "
                            'lm_head.weight: set "tie_word_embeddings": true if the head is the embedding, or add '
                            "lm_head.weight")


def test_export_shards_above_size_and_reimports(tmp_path):
    cfg, params = hf.load_hf_checkpoint(fixture("hf_qwen2"))
    out = hf.export_hf_checkpoint(cfg, params, tmp_path / "sharded", max_shard_bytes=8000)
    files = pathlib_files(out)
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 3 and hf.INDEX_FILE in files and hf.SINGLE_FILE not in files
    index = json.loads((out / hf.INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == 4 * cfg.n_params
    for f in shards:  # at most 8000 bytes of data, or one larger tensor alone
        header, start = hf.read_header(out / f)
        data = os.path.getsize(out / f) - start
        assert data <= 8000 or len(header) == 2, (f, data, list(header))
    cfg2, p2 = hf.load_hf_checkpoint(out)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(FileExistsError):
        hf.export_hf_checkpoint(cfg, params, out)
    # an explicit size re-shards a sharded source; a tiny size gives each tensor its own shard
    one = hf.export_hf_checkpoint(cfg, params, tmp_path / "one", source=hf.open_hf_checkpoint(out),
                                  max_shard_bytes=10**9)
    assert pathlib_files(one) == ["config.json", "model.safetensors"]


def test_to_leaf_threads_and_parallel_shards_bit_exact(tmp_path, monkeypatch):
    """The import's fast paths equal the plain ones bit for bit: :func:`models.hf.to_leaf` (a
    banded transpose on threads, bf16 widened by a 16-bit shift) against numpy's transpose and
    cast, NaN/inf/-0 included; a tensor read in parts by threads; shards written 3 at once give
    the files of one writer."""
    rng = np.random.default_rng(0)
    for src in (np.float32, hf._BF16, np.float16):
        a = rng.standard_normal((1500, 701)).astype(src)  # over _THREADED_ELEMS: threaded
        a.reshape(-1)[:4] = [np.nan, np.inf, -np.inf, -0.0]
        for transpose in (True, False):
            for dst in (np.float32, hf._BF16, src):
                got = hf.to_leaf(a, transpose, dst, threads=3)
                ref = np.ascontiguousarray(a.T if transpose else a, dtype=dst)
                assert got.dtype == ref.dtype and got.shape == ref.shape and got.flags.c_contiguous
                assert got.tobytes() == ref.tobytes(), (np.dtype(src).name, transpose, np.dtype(dst).name)
    cfg, params = hf.load_hf_checkpoint(fixture("hf_llama3"))
    monkeypatch.setattr(hf, "_THREADED_READ_BYTES", 256)  # every tensor of the fixture read in parts
    _, again = hf.load_hf_checkpoint(fixture("hf_llama3"))
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
    src = hf.open_hf_checkpoint(fixture("hf_llama3"))
    one = hf.export_hf_checkpoint(cfg, params, tmp_path / "one", source=src, max_shard_bytes=6000)
    three = hf.export_hf_checkpoint(cfg, params, tmp_path / "three", source=src, max_shard_bytes=6000, workers=3)
    files = pathlib_files(one)
    assert len([f for f in files if f.endswith(".safetensors")]) >= 3 and pathlib_files(three) == files
    for f in files:
        assert (one / f).read_bytes() == (three / f).read_bytes(), f


_RSS_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[2])
from models import hf
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
base = status("VmRSS:")
cfg, params = hf.load_hf_checkpoint(sys.argv[1])
print(base, status("VmHWM:"), sum(a.nbytes for a in __import__("jax").tree.leaves(params)))
"""


def test_sharded_load_streams_peak_rss(tmp_path):
    """A 52 MB float32 checkpoint in 4 shards: loading grows host memory by less than twice its
    size (the params plus one tensor; a reader that held a shard or the whole file besides the
    params would show more)."""
    cfg = llama.LlamaConfig(name="rss", vocab_size=8192, d_model=512, n_layers=2, n_heads=8, n_kv_heads=4,
                            head_dim=64, d_ff=1024, family="llama", tie_embeddings=False)
    shapes = jax.eval_shape(lambda: llama.init_params(cfg, jax.random.key(0)))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.standard_normal(a.shape, np.float32), shapes)
    out = hf.export_hf_checkpoint(cfg, params, tmp_path / "big", max_shard_bytes=16 * 2**20 + 1)
    del params
    size = sum(os.path.getsize(out / f) for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) >= 4
    res = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(out), ROOT], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert res.returncode == 0, res.stderr[-2000:]
    base, peak, nbytes = map(int, res.stdout.split())
    growth = peak - base
    print(f"checkpoint {size / 2**20:.1f} MiB; params {nbytes / 2**20:.1f} MiB; RSS {base / 2**20:.0f} -> peak "
          f"{peak / 2**20:.0f} MiB: growth {growth / size:.2f}x the checkpoint")
    assert nbytes >= 0.99 * size  # all of it was loaded
    assert growth < 2 * size


def test_open_refuses_bad_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        hf.open_hf_checkpoint(tmp_path)

    def variant(name, edit=None, drop=None):
        return _broken(tmp_path, name, edit=edit, drop=drop)

    cases = [
        (variant("gpt2", lambda hc: hc.update(model_type="gpt2")), "model_type 'gpt2' is not of the Llama family"),
        (variant("yarn", lambda hc: hc.update(rope_parameters={"rope_type": "yarn", "factor": 4.0})),
         "rope_scaling type 'yarn' is not supported"),
        (variant("gelu", lambda hc: hc.update(hidden_act="gelu")), "hidden_act 'gelu'"),
        (variant("layers", lambda hc: hc.update(num_hidden_layers=3)), "model.layers.2.input_layernorm.weight is missing"),
        (variant("width", lambda hc: hc.update(intermediate_size=40)), "mlp.gate_proj.weight has shape"),
        (variant("shard", drop="model-00002-of-00003.safetensors"), "names model-00002-of-00003.safetensors"),
    ]
    for d, msg in cases:
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")) as e:
            hf.open_hf_checkpoint(d)
        assert "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        hf.open_hf_checkpoint(variant("noweights", drop=hf.INDEX_FILE))


def _broken(tmp_path, name, src="hf_llama3", edit=None, drop=None, write=None, truncate=None):
    """A copy of fixture ``src`` in ``tmp_path / name`` with config.json edited (``edit(hc)``), a
    file dropped, files overwritten (``write``: {file: text}) or cut (``truncate``: {file: bytes})."""
    d = tmp_path / name
    shutil.copytree(fixture(src), d)
    if edit:
        hc = json.loads((d / "config.json").read_text())
        edit(hc)
        (d / "config.json").write_text(json.dumps(hc))
    if drop:
        os.remove(d / drop)
    for f, text in (write or {}).items():
        (d / f).write_text(text)
    for f, cut in (truncate or {}).items():
        os.truncate(d / f, os.path.getsize(d / f) - cut)
    return d


def test_open_refuses_broken_files(tmp_path):
    """Malformed config.json / tokenizer.json / truncated weights: one line naming the file and the
    key, raised when the folder is opened (no weights read)."""
    def pop(*keys):
        return lambda hc: [hc.pop(k) for k in keys]
    llama3 = {"rope_type": "llama3", "factor": 8.0}
    cases = [
        (dict(edit=lambda hc: hc.update(rope_scaling="llama3")),
         "rope_scaling 'llama3' must be an object such as {\"rope_type\": \"llama3\", \"factor\": 8.0, ...} or null"),
        (dict(edit=lambda hc: hc.update(rope_parameters=[1])), "rope_parameters [1] must be an object"),
        (dict(edit=pop("num_hidden_layers")), "config.json: num_hidden_layers missing"),
        (dict(edit=pop("hidden_size", "vocab_size")), "config.json: vocab_size, hidden_size missing"),
        (dict(edit=lambda hc: hc.update(rope_parameters=None, rope_scaling=llama3)),
         "rope_scaling of type llama3 lacks low_freq_factor, high_freq_factor, original_max_position_embeddings"),
        (dict(edit=lambda hc: hc.update(rope_parameters={"rope_type": "linear"})),
         "rope_scaling of type linear lacks factor"),
        (dict(edit=lambda hc: hc.update(hidden_size="wide")), "config.json: a size or RoPE setting is not a number"),
        (dict(edit=lambda hc: hc.update(num_key_value_heads=3)), "config.json: n_heads=2 is not a multiple of n_kv_heads=3"),
        (dict(write={"config.json": "{"}), "config.json: not valid JSON"),
        (dict(write={"config.json": "[]"}), "config.json: a JSON object of settings is expected"),
        (dict(write={hf.INDEX_FILE: "{}"}), "model.safetensors.index.json: no weight_map"),
        (dict(truncate={"model-00003-of-00003.safetensors": 4}), "file ends inside the tensor (truncated download?)"),
        (dict(src="hf_qwen2", truncate={"model.safetensors": 100}), "file ends inside the tensor (truncated download?)"),
    ]
    for k, (kw, msg) in enumerate(cases):
        d = _broken(tmp_path, f"case{k}", **kw)
        with pytest.raises(ValueError) as e:
            hf.open_hf_checkpoint(d)
        assert msg in str(e.value) and str(d) in str(e.value) and "\n" not in str(e.value), (k, str(e.value))
    d = _broken(tmp_path, "tok", write={"tokenizer.json": "{1: 2}"})
    ck = hf.open_hf_checkpoint(d)
    with pytest.raises(ValueError) as e:
        ck.tokenizer()
    assert f"{d / 'tokenizer.json'}: not a valid tokenizer.json" in str(e.value) and "\n" not in str(e.value)


def test_job_refuses_broken_folders(capsys, tmp_path):
    """The job turns each broken folder into one line and exit 2, with nothing in --out-dir."""
    out = tmp_path / "runs"
    cases = [
        (_broken(tmp_path, "noconfig", drop="config.json"), "config.json is missing"),
        (_broken(tmp_path, "badjson", write={"config.json": "{"}), "config.json: not valid JSON"),
        (_broken(tmp_path, "rope", edit=lambda hc: hc.update(rope_scaling="llama3")), "rope_scaling 'llama3'"),
        (_broken(tmp_path, "tok", write={"tokenizer.json": "{1: 2}"}), "not a valid tokenizer.json"),
        (_broken(tmp_path, "cut", src="hf_qwen2", truncate={"model.safetensors": 100}), "truncated download?"),
        (_broken(tmp_path, "nohead", src="hf_qwen2", edit=lambda hc: hc.pop("tie_word_embeddings")),
         "tie_word_embeddings is absent (false) but"),
    ]
    for d, msg in cases:
        assert train.main(["--init-from", str(d), "--steps", "1", "--out-dir", str(out)]) == 2, d
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and msg in lines[0] and str(d) in lines[0], lines
        assert not out.exists() or not os.listdir(out)


def test_config_dict_round_trip():
    for name in NAMES:
        cfg = hf.open_hf_checkpoint(fixture(name)).config
        assert hf.config_from_hf(hf.hf_config_dict(cfg)) == cfg
    base = llama.LlamaConfig(head_dim=8, rope_theta=10000.0)
    linear = hf.config_from_hf(hf.hf_config_dict(llama.LlamaConfig(head_dim=8, rope_type="linear", rope_factor=4.0)))
    assert linear.rope_type == "linear" and linear.rope_factor == 4.0
    np.testing.assert_allclose(llama.rope_inv_freq(dataclasses.replace(base, rope_type="linear", rope_factor=4.0)),
                               llama.rope_inv_freq(base) / 4, rtol=1e-7)
    with pytest.raises(ValueError, match="has no transformers config"):
        hf.hf_config_dict(llama.LlamaConfig(family="mistral", bias_projs=("q_proj",)))


# ---- loss masks in the batch ------------------------------------------------------------------

def test_masked_loss_and_fused_head_equal_plain():
    cfg, params = hf.load_hf_checkpoint(fixture("hf_llama2"))
    p = {k: jnp.asarray(params[k]) if k == "embed" else jax.tree.map(jnp.asarray, params[k])
         for k in llama.head_keys(cfg)}
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 8, cfg.d_model)), jnp.float32)
    t = rng.integers(0, cfg.vocab_size, (2, 8))
    keep = rng.random((2, 8)) < 0.6
    tm = jnp.asarray(np.where(keep, t, -1 - t), jnp.int32)
    logits = llama.head_logits(cfg, p, x)
    ce = -jax.nn.log_softmax(logits)[np.arange(2)[:, None], np.arange(8)[None], t]
    want = float(ce[keep].mean())
    loss = jax.jit(lambda q, y, tt, piece: llama.head_loss(cfg, q, y, tt, piece), static_argnums=3)
    plain = loss(p, x, tm, 1024)  # 16 tokens: the unfused path
    fused = loss(p, x, tm, 4)
    np.testing.assert_allclose([float(plain), float(fused)], [want, want], rtol=1e-6)
    weighted = jax.jit(lambda q, y, tt, piece: llama.head_loss(cfg, q, y, tt, piece, weighted=True), static_argnums=3)
    for piece in (1024, 4):  # weighted: the sum over counted targets and their count (chunkjax.loss_weight)
        wl = weighted(p, x, tm, piece)
        assert float(wl.weight) == keep.sum()
        np.testing.assert_allclose(float(wl.total), want * keep.sum(), rtol=1e-6)
    np.testing.assert_allclose(float(loss(p, x, jnp.asarray(t, jnp.int32), 1024)), float(ce.mean()), rtol=1e-6)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=3)
    g1, g2 = grad(p, x, tm, 1024), grad(p, x, tm, 4)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert not np.asarray(g1[1])[~keep].any()  # a skipped target sends no gradient
    assert float(loss(p, x, -1 - jnp.asarray(t, jnp.int32), 1024)) == 0.0  # nothing counted
    np.testing.assert_array_equal(llama.embed_apply(p | {"embed": params["embed"]}, None, tm),
                                  params["embed"][t])  # inputs decode masked ids


# ---- your own data ----------------------------------------------------------------------------

def char_tokenizer():
    """ids = byte values + 2; end of text 1; never 0 (so a masked id is always < 0)."""
    return Tokenizer("chars", 258, 1, lambda s: [b + 2 for b in s.encode()], lambda ids: bytes(i - 2 for i in ids
                                                                                               if i >= 2).decode())


def test_user_data_text_and_jsonl(tmp_path):
    tok = char_tokenizer()
    text = "\n\n".join(f"paragraph {i} of the text." for i in range(20))
    (tmp_path / "a.txt").write_text(text)
    lines = [{"prompt": f"Q{i}:", "completion": f" A{i}."} for i in range(10)] + [{"text": "plain doc."}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    td = user_data.load_user_data(f"{tmp_path / 'a.txt'},{tmp_path / 'b.jsonl'}", tok, val_fraction=0.3, seed=1)
    assert td.train.dtype == np.int32 and td.meta["train_examples"] + td.meta["val_examples"] == 31
    assert 0 < td.meta["val_examples"] < 31 and td.meta["data_files"][0].endswith("a.txt")
    both = np.concatenate([td.train, td.val])
    decoded = tok.decode(np.where(both < 0, -1 - both, both))
    for i in range(20):
        assert f"paragraph {i} of the text." in decoded  # every paragraph in one split or the other
    # prompts masked, completions and the end of text counted
    train = td.train.tolist()
    k = next(j for j in range(len(train)) if train[j] == -1 - (ord("Q") + 2))
    prompt_len = len(train[k:]) - len(train[k:]) + next(j for j in range(k, len(train)) if train[j] >= 0) - k
    assert tok.decode([-1 - v for v in train[k:k + prompt_len]]).startswith("Q")
    rest = train[k + prompt_len:]
    completion = rest[:rest.index(1) + 1]
    assert tok.decode(completion).startswith(" A") and completion[-1] == tok.eot_id
    assert td.meta["masked_train_tokens"] == int((td.train < 0).sum()) > 0
    # a text file's paragraphs are one document: no end of text inside it
    assert tok.decode(td.train[:td.train.tolist().index(1)]).startswith("paragraph")
    # same split for the same seed; a folder gives its files sorted
    td2 = user_data.load_user_data(str(tmp_path), tok, val_fraction=0.3, seed=1)
    np.testing.assert_array_equal(td.train, td2.train)
    from experiments.data import unigram_cross_entropy
    assert np.isfinite(unigram_cross_entropy(td.train, td.val, tok.vocab_size))


def test_user_data_bos_before_documents_and_prompts_only(tmp_path):
    """A tokenizer that adds BOS (as Llama's): once at each document and prompt, masked before a
    prompt, never before a completion."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    from experiments.job_model import wrap_tokenizer
    raw = HFTokenizer.from_file(os.path.join(fixture("hf_llama3"), "tokenizer.json"))
    raw.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = wrap_tokenizer(raw, "bos", 1)
    assert tok.encode("to be")[0] == 0
    (tmp_path / "qa.jsonl").write_text("\n".join(json.dumps({"prompt": f"to be {i}?", "completion": " or not."})
                                                 for i in range(6)) + "\n" + json.dumps({"text": "the sea."}) + "\n")
    td = user_data.load_user_data(str(tmp_path / "qa.jsonl"), tok, val_fraction=0.2, seed=0)
    both = np.concatenate([td.train, td.val])
    assert int((both == -1).sum()) == 6 and int((both == 0).sum()) == 1  # masked BOS per prompt; one document BOS
    for k in np.flatnonzero(both == -1):  # each prompt starts with a masked BOS, its completion has none
        assert both[k - 1] == 1 if k else True


def test_user_data_errors(tmp_path):
    tok = char_tokenizer()
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"question": "x"}\n')
    (tmp_path / "notjson.jsonl").write_text('{"text": "ok"}\nnot json\n')
    (tmp_path / "one.txt").write_text("just one paragraph")
    (tmp_path / "small.txt").write_text("a\n\nb\n\nc")
    (tmp_path / "empty").mkdir()
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait\n\nsecond paragraph".encode("latin-1"))
    cases = [(str(tmp_path / "missing.txt"), "no such file or folder"),
             (str(tmp_path / "latin1.txt"), r"latin1.txt: not UTF-8 text \(byte 0xe9 at offset 3\): save it as UTF-8"),
             (str(tmp_path / "bad.jsonl"), r"bad.jsonl:2: expected"),
             (str(tmp_path / "notjson.jsonl"), r"notjson.jsonl:2: not JSON"),
             (str(tmp_path / "one.txt"), "need at least 2"),
             (str(tmp_path / "empty"), "has no .txt"),
             ("", "names no file")]
    for spec, msg in cases:
        with pytest.raises(ValueError, match=msg) as e:
            user_data.load_user_data(spec, tok)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="held-out split has .* tokens, fewer than the 1000"):
        user_data.load_user_data(str(tmp_path / "small.txt"), tok, min_val_tokens=1000)


# ---- one job ----------------------------------------------------------------------------------

def test_job_finetunes_an_imported_checkpoint(tmp_path, monkeypatch):
    """``python -m experiments.train --init-from <folder> --data text,jsonl``: a few steps of the
    sharded bfloat16 Llama-3-shaped fixture; held-out loss falls; the run folder holds the report,
    loss curve, samples and the export, which re-imports in the source's layout and dtype. The
    weights go into the chunks leaf by leaf: the job never builds the params pytree."""
    def no_pytree(self, dtype=None):
        raise AssertionError("the job read the whole checkpoint as a params pytree")

    monkeypatch.setattr(hf.HFCheckpoint, "params", no_pytree)
    src = tmp_path / "my-llama3"
    shutil.copytree(fixture("hf_llama3"), src)
    words = "the sea of troubles arms fortune slings and arrows outrageous mind to be or not question".split()
    rng = np.random.default_rng(0)
    (tmp_path / "notes.txt").write_text("\n\n".join(" ".join(rng.choice(words, 30)) for _ in range(40)))
    (tmp_path / "qa.jsonl").write_text("\n".join(json.dumps({"prompt": f"to be {w}?", "completion": " or not to be."})
                                                 for w in words) + "\n")
    out = tmp_path / "runs"
    rc = train.main(["--init-from", str(src), "--data", f"{tmp_path / 'notes.txt'},{tmp_path / 'qa.jsonl'}",
                     "--steps", "6", "--batch", "2", "--seq", "32", "--eval-every", "3", "--eval-batches", "2",
                     "--sample-tokens", "4", "--lr", "3e-3", "--warmup", "0", "--no-progress", "--out-dir", str(out),
                     "--checkpoint-every", "0"])  # no checkpoint (the job's checkpoints: tests/test_train_job.py)
    assert rc == 0
    (run,) = out.iterdir()
    assert run.name.endswith("-my-llama3-ft")
    assert {"report.json", "metrics.jsonl", "loss.png", "sample.txt", "hf"} <= set(os.listdir(run))
    rep = json.loads((run / "report.json").read_text())
    assert rep["init_from"] == str(src) and rep["tokenizer"] == "hf" and rep["config"]["data"]
    assert len(rep["data_files"]) == 2 and rep["masked_train_tokens"] > 0 and rep["val_examples"] >= 1
    assert rep["val_loss_last"] < rep["val_loss_first"]
    assert rep["sample_before"] and rep["sample"]
    monkeypatch.undo()
    ck = hf.open_hf_checkpoint(run / "hf")
    orig = hf.open_hf_checkpoint(src)
    assert dataclasses.replace(ck.config, name="") == dataclasses.replace(orig.config, name="")
    assert pathlib_files(run / "hf") == pathlib_files(src)  # the source's shards, index, tokenizer
    assert all(ck.dtype(n) == np.dtype("bfloat16") for n in ck.entries)
    moved = [not np.array_equal(ck.tensor(n), orig.tensor(n)) for n in orig.entries]
    assert sum(moved) >= len(moved) - 2  # trained (a bf16 norm scale may round back to its value)


def test_job_data_errors(capsys, tmp_path):
    assert train.main(["--data", "x.txt"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --data needs --init-from (the checkpoint's tokenizer reads it): "
                                               "add --init-from <folder>")
    assert train.main(["--init-from", fixture("hf_qwen2"), "--data", str(tmp_path / "nope.txt"),
                       "--out-dir", str(tmp_path / "runs")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "no such file or folder" in lines[0], lines
    assert not (tmp_path / "runs").exists() or not os.listdir(tmp_path / "runs")
    cfg = train.parse_args(["--init-from", fixture("hf_qwen2")])
    assert (cfg.model, cfg.tokenizer, cfg.seq) == ("hf_qwen2", "hf", 128)  # seq capped at the model's positions


def test_masked_held_out_loss_is_the_mean_over_scored_tokens(capsys, tmp_path, monkeypatch):
    """Prompt/completion data score completion tokens only. The held-out loss was the mean of each
    eval batch's own mean, so it changed with --batch and --eval-batches (6.0207 as one batch of 2
    rows, 6.0130 as two batches of 1, on a fresh user's data), and under ZeRO or micro-batches the
    training loss and gradients were a mean of per-rank means too. Right: the held-out loss is the
    mean over every scored token however the windows are grouped (fp32: 1e-6), and the split runs
    were refused. Now the loss is normalised by the global count of scored tokens
    (chunkjax.loss_weight): --micro-batches 2 trains as one batch of 2 (losses and held-out losses
    equal to fp32 summation order, 1e-5). A training batch of prompts only is skipped (no state
    changed: the held-out loss after it equals the one before)."""
    words = "the sea of troubles arms fortune slings and arrows outrageous mind to be or not question".split()
    rng = np.random.default_rng(3)
    (tmp_path / "qa.jsonl").write_text("\n".join(json.dumps({"prompt": " ".join(rng.choice(words, int(rng.integers(3, 12)))),
                                                            "completion": " " + " ".join(rng.choice(words, 9))})
                                                for _ in range(160)) + "\n")
    common = ["--init-from", fixture("hf_llama3"), "--data", str(tmp_path / "qa.jsonl"), "--seq", "32",
              "--eval-every", "1", "--sample-tokens", "0", "--warmup", "0", "--no-progress", "--checkpoint-every", "0",
              "--export", "none", "--compute-dtype", "float32"]
    vals, metrics = [], {}
    for batch, eval_batches, mb in ((2, 1, 1), (1, 2, 1), (2, 1, 2)):
        out = tmp_path / f"runs{batch}-{mb}"
        steps = "1" if batch == 1 else "3"
        with monkeypatch.context() as m:
            if batch == 1:  # its one training batch all prompt
                sample = data_mod.sample_batches
                m.setattr(data_mod, "sample_batches", lambda *a: (-1 - np.abs(b) for b in sample(*a)))
            assert train.main(common + ["--batch", str(batch), "--eval-batches", str(eval_batches), "--steps", steps,
                                        "--micro-batches", str(mb), "--out-dir", str(out)]) == 0
        (run,) = out.iterdir()
        rep = json.loads((run / "report.json").read_text())
        assert rep["skipped_steps"] == ([1] if batch == 1 else [])
        assert 0 < rep["val_tokens_scored"] < 2 * 32  # prompts are not scored
        vals.append(rep["val_loss_first"])
        metrics[batch, mb] = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(vals[0], vals[1], rtol=1e-6)
    assert metrics[1, 1][-1]["val_loss"] == metrics[1, 1][0]["val_loss"] and "scores no token" in capsys.readouterr().out
    one, two = ([(r.get("loss"), r["val_loss"]) for r in metrics[2, mb]] for mb in (1, 2))
    assert len(one) == 4 and one[0][0] is None and one[-1][1] < one[0][1]
    assert one[0] == (None, vals[0]) and two[0][0] is None
    np.testing.assert_allclose(np.array(one[1:]), np.array(two[1:]), rtol=1e-5)
    np.testing.assert_allclose(two[0][1], one[0][1], rtol=1e-6)


# ---- live, against transformers ---------------------------------------------------------------

_LIVE = r"""
import json, sys
import numpy as np, torch, transformers
jobs = json.loads(sys.argv[1])
out = {}
for k, (d, ids) in enumerate(jobs):
    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out[f"logits{k}"] = m(torch.tensor([ids])).logits[0].numpy()
np.savez(sys.argv[2], **out)
"""


def _ref_python():
    import importlib.util
    if all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers")):
        return sys.executable
    py = os.environ.get("HF_REF_PYTHON")
    return py if py and os.path.exists(py) else None


@pytest.mark.skipif(_ref_python() is None, reason="needs torch + transformers (or HF_REF_PYTHON)")
def test_live_transformers_matches(tmp_path, refs):
    """transformers reads each fixture and our export of it with every tensor changed, and
    computes our logits."""
    jobs, ours = [], []
    rng = np.random.default_rng(0)
    for d in _head_variants(tmp_path).values():  # a tied folder that also holds lm_head.weight, three ways
        ck = hf.open_hf_checkpoint(d)
        jobs.append((str(d), refs["hf_qwen2_ids"].tolist()))
        ours.append(np.asarray(llama.forward_logits(ck.config, ck.params(), jnp.asarray(refs["hf_qwen2_ids"][None])))[0])
    for name in NAMES:
        ck = hf.open_hf_checkpoint(fixture(name))
        ids = refs[f"{name}_ids"]
        params = jax.tree.map(lambda a: (a + 0.05 * rng.standard_normal(a.shape)).astype(np.float32), ck.params())
        out = hf.export_hf_checkpoint(ck.config, params, tmp_path / name, source=ck, dtype=np.float32)
        for d, p in ((ck.path, ck.params()), (out, params)):
            jobs.append((str(d), ids.tolist()))
            ours.append(np.asarray(llama.forward_logits(ck.config, p, jnp.asarray(ids[None])))[0])
    res = subprocess.run([_ref_python(), "-c", _LIVE, json.dumps(jobs), str(tmp_path / "live.npz")],
                         capture_output=True, text=True, timeout=600,
                         env={"PATH": os.environ.get("PATH", ""), "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    live = np.load(tmp_path / "live.npz")
    for k, mine in enumerate(ours):
        err = np.abs(live[f"logits{k}"] - mine).max()
        print(f"{jobs[k][0]}: max |logit(transformers) - logit(ours)| = {err:.2e}")
        assert err <= LOGIT_ATOL


def test_job_names_a_nonfinite_checkpoint_weight(capsys, tmp_path):
    """A NaN in a checkpoint's weights was reported as 'loss became nan at step 1: lower --lr or
    keep --clip > 0' (the held-out loss before training was already NaN). Right: refused after
    the first evaluation in one line naming the weight, exit 2, no run folder left."""
    from safetensors.numpy import load_file, save_file
    d = _broken(tmp_path, "nanw")
    shard = d / "model-00002-of-00003.safetensors"
    ts = load_file(str(shard))
    name = sorted(n for n in ts if n.endswith("down_proj.weight"))[0]
    ts[name] = ts[name].copy()
    ts[name].reshape(-1)[7] = np.nan
    save_file(ts, str(shard), metadata={"format": "pt"})
    words = "the sea of troubles arms fortune slings and arrows outrageous mind to be or not question".split()
    rng = np.random.default_rng(1)
    (tmp_path / "t.txt").write_text("\n\n".join(" ".join(rng.choice(words, 30)) for _ in range(40)))
    rc = train.main(["--init-from", str(d), "--data", str(tmp_path / "t.txt"), "--steps", "2", "--batch", "2",
                     "--seq", "32", "--sample-tokens", "0", "--no-progress", "--out-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err, err
    assert "before training is nan" in err and "down_proj" in err and "NaN or inf" in err, err
    assert not (tmp_path / "runs").exists() or not os.listdir(tmp_path / "runs")
