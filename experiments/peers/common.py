"""Torch-free pieces of the peer benchmarks (issue 9): the DeepSpeed configs, the record
arithmetic (same FLOP formula and keys as :mod:`experiments.bench`) and the docs table. Tested on
the CPU (tests/test_peers.py); the torch side is :mod:`experiments.peers.deepspeed_gpt`."""
from __future__ import annotations

import statistics

#: peer system -> what it is, for tables
PEERS = {
    "ds_zero_offload": "DeepSpeed ZeRO-Offload: ZeRO stage 2, optimizer state and its AdamW update on the CPU "
                       "(DeepSpeedCPUAdam), bf16 params and gradients on the GPU",
    "ds_zero_infinity": "DeepSpeed ZeRO-Infinity: ZeRO stage 3, params and optimizer state offloaded "
                        "(CPU, or NVMe with --nvme-dir), AdamW on the CPU",
}


def ds_config(system: str, batch: int, lr: float = 1e-4, weight_decay: float = 1e-4,
              nvme_dir: str | None = None) -> dict:
    """The DeepSpeed config of ``system`` (a key of :data:`PEERS`) under the benchmark settings:
    one micro-batch of ``batch`` sequences, AdamW ``lr`` without clipping, bf16 with fp32 master.

    Raises:
      ValueError: unknown system.
    """
    if system not in PEERS:
        raise ValueError(f"unknown peer {system!r}: choose one of {', '.join(PEERS)}")
    off = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True} if nvme_dir else \
        {"device": "cpu", "pin_memory": True}
    zero = {"stage": 2, "offload_optimizer": dict(off), "contiguous_gradients": True, "overlap_comm": True}
    if system == "ds_zero_infinity":
        zero = {"stage": 3, "offload_optimizer": dict(off), "offload_param": dict(off),
                "contiguous_gradients": True, "overlap_comm": True}
    return {"train_micro_batch_size_per_gpu": int(batch), "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0, "bf16": {"enabled": True}, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay,
                                                      "betas": [0.9, 0.999], "eps": 1e-8}},
            "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}


def peer_record(rec: dict, jax_matmul_tflops: float | None = None) -> dict:
    """Fill the derived keys of a peer's record: ``step_s_median`` (median of ``step_s_all``),
    ``tokens_per_s``, ``tflops`` (6N + 12 L S h per token, N of our config: definitions.md),
    ``mfu`` (against ``jax_matmul_tflops``, the bench's probe in the same call, if given),
    ``mfu_torch_matmul`` (against the record's ``torch_matmul_tflops``), ``losses_finite`` and
    ``loss_falling``. Returns ``rec`` (changed in place)."""
    from experiments.bench import finalize_record
    from models import gpt
    steps = rec.get("step_s_all") or []
    if steps and rec.get("model"):
        cfg = gpt.get_config(rec["model"])
        med = statistics.median(steps)
        rec["step_s_median"] = med
        rec["tokens_per_s"] = rec["batch"] * rec["seq"] / med
        rec["n_params"] = cfg.n_params
        finalize_record(rec, cfg.flops_per_token(rec["seq"]), jax_matmul_tflops, None)  # the bench's MFU
        if rec.get("torch_matmul_tflops"):
            rec["mfu_torch_matmul"] = rec["tflops"] / rec["torch_matmul_tflops"]
    losses = rec.get("losses") or []
    if losses:
        rec["losses_finite"] = all(x == x and abs(x) != float("inf") for x in losses)
        rec["loss_falling"] = losses[-1] < losses[0]
        if not rec["losses_finite"]:
            rec["feasible"] = False
            rec["error"] = rec.get("error") or f"non-finite loss: {losses}"
    return rec
