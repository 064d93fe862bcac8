"""Write the tiny Hugging Face checkpoints of tests/fixtures/hf_* and their reference logits.

Run with torch + transformers + tokenizers (a separate environment: the main one has no torch)::

    python experiments/make_hf_fixtures.py [--out tests/fixtures]

One folder per family, each a random model saved by transformers' own ``save_pretrained`` with
a small byte-level BPE ``tokenizer.json`` (trained here, 280 ids):

* ``hf_llama2``: Llama 2 layout: multi-head attention (kv heads = heads), untied head, float32.
* ``hf_llama3``: Llama 3.1 layout: GQA, untied head, ``rope_scaling`` of type llama3 (its three
  frequency bands all present at head_dim 8), **bfloat16** weights, **sharded** (index file).
* ``hf_mistral``: Mistral: GQA, untied head, ``sliding_window`` 4 (the reference sequence is
  longer, so the window matters), float32.
* ``hf_qwen2``: Qwen2: biases on q/k/v, tied head, float32.

Weights are drawn with ``initializer_range`` 0.2, and norm scales and biases are moved away from
their init (1, 0), so a mistake in any tensor shows in the logits. ``hf_refs.npz`` holds, per
folder, the token ids of a sentence (``<name>_ids``) and transformers' float32 logits for them
(``<name>_logits``, (T, V)), plus the library versions (``versions``). The whole set is about
430 KB.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

TEXT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
        "arrows of outrageous fortune, or to take arms against a sea of troubles, and by opposing end them. ") * 4
PROMPT = "To be, or not to be: arms, fortune and the sea."
SIZES = dict(vocab_size=288, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.2,
             bos_token_id=0, eos_token_id=1)
FAMILIES = {
    "hf_llama2": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0), "float32", None),
    "hf_llama3": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=False, rope_theta=10000.0,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
                  "bfloat16", "12KB"),
    "hf_mistral": ("mistral", dict(num_key_value_heads=1, tie_word_embeddings=False, rope_theta=10000.0,
                                   sliding_window=4), "float32", None),
    "hf_qwen2": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=True, rope_theta=10000.0,
                               use_sliding_window=False), "float32", None),
}


def make_tokenizer():
    """A byte-level BPE of 280 ids trained on :data:`TEXT`, ``<s>`` = 0 and ``</s>`` = 1, as a
    transformers fast tokenizer (no BOS added, so ids are the text's alone)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([TEXT], vocab_size=280, min_frequency=1, special_tokens=["<s>", "</s>"],
                            show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>")


def main(argv=None):
    import numpy as np
    import tokenizers
    import torch
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                  "tests", "fixtures"))
    args = ap.parse_args(argv)
    tok = make_tokenizer()
    ids = tok(PROMPT)["input_ids"]
    refs = {"versions": np.asarray(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                               "tokenizers": tokenizers.__version__}))}
    for k, (name, (family, extra, dtype, shard)) in enumerate(FAMILIES.items()):
        cfg = transformers.AutoConfig.for_model(family, **SIZES, **extra)
        torch.manual_seed(k)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.copy_(1 + 0.2 * torch.randn_like(p))
                elif pname.endswith("bias"):
                    p.copy_(0.2 * torch.randn_like(p))
        folder = os.path.join(args.out, name)
        shutil.rmtree(folder, ignore_errors=True)
        model.to(getattr(torch, dtype)).save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
        tok.save_pretrained(folder)
        # the reference: transformers' own loader reading that folder, computing in float32
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                attn_implementation="eager").eval()
        with torch.no_grad():
            logits = ref(torch.tensor([ids])).logits[0].numpy().astype(np.float32)
        refs[f"{name}_ids"] = np.asarray(ids, np.int32)
        refs[f"{name}_logits"] = logits
        print(f"{name}: {sorted(os.listdir(folder))}, logits {logits.shape}, max |logit| {np.abs(logits).max():.2f}")
    np.savez_compressed(os.path.join(args.out, "hf_refs.npz"), **refs)


if __name__ == "__main__":
    main()
