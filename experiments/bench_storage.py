"""Storage-tier benchmark (issue 6): ZeRO-Infinity baseline vs near-storage updates (Smart-Infinity).

    python -m experiments.bench_storage --mode links --workers 1,2,4,8 --params 4e6 --chunk 65536 --scale 100
    python -m experiments.bench_storage --mode train --steps 300

``--mode links`` runs, side by side for each worker count (one storage directory per worker),
three optimizers on a synthetic model of ``--params`` float32 parameters in chunks of ``--chunk``
elements (random gradients, fixed seed), ``--steps`` timed steps after one warm-up step (median):

* ``baseline`` (ZeRO-Infinity with the optimizer on NVMe): every chunk file holds fp32 master, m, v
  *and the fp32 gradient* (ZeRO-Infinity swaps the fp32 gradient partition out to storage in the
  backward pass and back in for the update); each step reads the four sections into host staging
  buffers, runs AdamW on the host and writes them back: 16 + 16 = 32 bytes/param, every byte
  through the shared host <-> storage link and the device's own link. (Here the gradient
  swap-out is the write of the 4th section in the same pipeline as the update, so it is counted
  in ``update_s``; the update uses the host copy of the gradient, equal to what is written.)
* ``near_storage`` (SmartUpdate): :class:`chunkjax.storage.near.NearStorageOptimizer`, one worker
  process per directory; bf16 gradients in, bf16 params out over the shared link (4 bytes/param),
  the state (24 bytes/param) only on each device's own link.
* ``near_storage_topk``: the same with top-k compression of each gradient chunk (``--topk``, 1 %
  default): int32 index + bf16 value per kept entry in, bf16 params out (about 2.06 bytes/param).

Two passes: *emulated* (the paper's link model: 3 GB/s per storage device behind one 16 GB/s shared
link, every rate divided by ``--scale`` so that a 2-core machine keeps up; all results labelled
``emulated: true``) and *real disk* (unthrottled, ``emulated: false``; no bound is given for it).

Analytic bound of the update-phase speedup
------------------------------------------
Links: one shared link of rate S, and n device links of rate D each, all behind the shared link
(a storage device and the processor next to it sit behind their one device link). Per parameter
and step, a design moving ``s`` bytes over the shared link and ``d`` bytes over the device links
(spread evenly over the n devices) needs at least ``max(s / S, d / (n D))`` seconds per param (each
link is a pipe that can overlap with the others, none faster than its rate):

* baseline: s = d = 32 (master, m, v, fp32 gradient read; master, m, v written; gradient written
  in backward): ``T_base(n) = max(32 / S, 32 / (n D))``;
* near storage with a shared-link payload of p bytes/param (p = 4 for bf16 in + bf16 out):
  the payload crosses the shared link and then the device link, the state stays on the device
  link: ``T_ns(n, p) = max(p / S, (24 + p) / (n D))``;
* bound = ``T_base(n) / T_ns(n, p)``.

With S = 16, D = 3 (GB/s): n = 8: T_base = 2.0, near_storage (p = 4) 28/24 -> **1.71x**, the
compression limit (p -> 0) 24/24 -> **2.0x**; n = 4: T_base = 32/12, near_storage 28/12 ->
**1.14x**, p -> 0: 24/12 -> **1.33x** (the issue's four numbers; its top-k figures are the p -> 0
limit, :func:`bound_speedup` with ``payload=0``). With top-k at 1 % the payload is ~2.06
bytes/param (0.06 in, 2 out), so its bound is 1.84x at 8 and 1.23x at 4: both are reported
(``bound_speedup`` with the measured payload, ``bound_speedup_limit`` with p -> 0). n = 1, 2:
the device links bind everything, bound 32/28 = 1.14x (p = 4), 1.33x (p -> 0).

The emulation throttles the shared link in the trainer process and each device link in its
worker process, so a near-storage payload is charged to the shared link only (a payload byte is
not serialised against its device's state traffic); instead the payload transfers come before
(gradients) and after (params) each worker's update, not overlapped with it. Measured speedups
may therefore differ from the bound in either direction by the payload time (p / S per param).
``bound_speedup_emulated`` is the bound of the emulated topology itself,
``T_base(n) / max(p / S, 24 / (n D))`` (1.33x at 1, 2 and 4 devices, 2.0x at 8, for p = 4).

``--mode train`` trains the main job's model (``experiments.train.TrainConfig`` defaults, its data
pipeline and validation loss) with the AdamW update (main job's schedule, weight decay, clipping)
running in :class:`NearStorageOptimizer` workers: gradients from ``jax.value_and_grad`` of the GPT
loss in float32 on the CPU, flattened into chunks and sent as float32; the workers' bf16 params
are the next step's params (the forward runs on them, upcast to float32). Runs with the same seed
and steps (``--variants``, default ``uncompressed,topk_global_emb0.5,topk_global_emb0.5_ef0.9``):
``uncompressed``, ``topk`` (1 % of every chunk, the paper), ``topk_ef`` (with error feedback),
and ``topk_global`` / ``topk_global_ef<decay>`` (1 % of the whole gradient,
:func:`chunkjax.storage.topk.topk_compress_global`; error feedback with the residual decayed by
``<decay>`` per step), ``topk_global_emb<share>`` (the same with ``<share>`` of the kept entries
reserved for the token embedding, ``topk_groups``). The
reference is the same loop in memory with the main job's optax optimizer
(``experiments.train._optimizer``) on float32 master params, the forward on their bf16 rounding;
the uncompressed run is compared against it for the first ``--compare-steps`` steps.

Bad input exits with status 2 and one line. Results: ``<results-dir>/storage_<run-id>.json``
(links) or ``storage_train_<run-id>.json`` (train), and a section in ``docs/storage.md``.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

#: The paper's link model (Smart-Infinity, evaluation setting), bytes/s, before ``--scale``.
PAPER_SHARED_BYTES_PER_S = 16e9
PAPER_DISK_BYTES_PER_S = 3e9
#: Bytes/param/step of the baseline on both links (see the module docstring) and of the state.
BASELINE_BYTES_PER_PARAM = 32
STATE_BYTES_PER_PARAM = 24
NEAR_STORAGE_PAYLOAD = 4  # bf16 gradient in + bf16 params out
MODES = ("baseline", "near_storage", "near_storage_topk")
DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "storage.md")


class UsageError(Exception):
    """Bad input: one line, exit status 2."""


# ----------------------------------------------------------------------------------------------
# The analytic bound.
# ----------------------------------------------------------------------------------------------

def bound_times(n: int, shared: float, disk: float, payload: float) -> tuple[float, float]:
    """(baseline, near-storage) seconds per parameter per step (lower bounds) with ``n`` devices of
    ``disk`` bytes/s behind a ``shared`` bytes/s link; ``payload`` near-storage bytes/param on the
    shared link. See the module docstring."""
    if n < 1 or not shared > 0 or not disk > 0 or payload < 0:
        raise ValueError(f"need n >= 1, positive rates, payload >= 0; got {n}, {shared}, {disk}, {payload}")
    t_base = max(BASELINE_BYTES_PER_PARAM / shared, BASELINE_BYTES_PER_PARAM / (n * disk))
    t_ns = max(payload / shared, (STATE_BYTES_PER_PARAM + payload) / (n * disk))
    return t_base, t_ns


def bound_speedup(n: int, shared: float = PAPER_SHARED_BYTES_PER_S, disk: float = PAPER_DISK_BYTES_PER_S,
                  payload: float = NEAR_STORAGE_PAYLOAD) -> float:
    """Analytic bound of the update-phase speedup of a near-storage mode over the baseline with ``n``
    devices (the paper's rates by default; only ratios matter). ``payload``: the mode's shared-link
    bytes/param (4 for near_storage; 0 gives the compression limit)."""
    t_base, t_ns = bound_times(n, shared, disk, payload)
    return t_base / t_ns


def bound_speedup_emulated(n: int, shared: float, disk: float, payload: float) -> float:
    """The bound for the emulation's own topology, where the payload is charged to the shared link
    only: ``T_base(n) / max(p / S, 24 / (n D))`` (an upper bound of what the emulation can measure)."""
    t_base, _ = bound_times(n, shared, disk, payload)
    return t_base / max(payload / shared, STATE_BYTES_PER_PARAM / (n * disk))


# ----------------------------------------------------------------------------------------------
# The ZeRO-Infinity baseline with the fp32 gradient on storage.
# ----------------------------------------------------------------------------------------------

class GradOffloadBaseline:
    """ZeRO-Infinity-style AdamW on storage: chunk files of (master, m, v, fp32 gradient), read
    into host staging buffers (n_dirs + 2 of them), updated on the host, written back; the
    gradient section is rewritten with the step's gradient (the swap-out) and read (the swap-in).
    Every storage byte crosses the shared link and its device link (DiskTier's link model)."""

    def __init__(self, dirs, chunk_sizes, spec, init_params, *, link_model=None, fsync=True, io_mode="auto",
                 read_ahead=1, n_buffers=None):
        from chunkjax.storage import DiskTier
        self.spec = spec
        self.chunk_sizes = dict(enumerate(chunk_sizes))
        self.n_params = sum(chunk_sizes)
        n = len(dirs)
        self.tier = DiskTier(dirs, self.chunk_sizes, n_kinds=4, n_buffers=n_buffers or read_ahead + n + 1,
                             read_ahead=read_ahead, io_threads=2 * n + read_ahead, io_mode=io_mode,
                             link_model=link_model, fsync=fsync)
        self.tier.initialize(init_params)

    def step(self, grads):
        import jax.numpy as jnp
        import numpy as np

        from chunkjax.host_update import learning_rate_at
        from chunkjax.kernels import clip_scale, step_hyper, update_
        from chunkjax.storage.near import BF16
        from chunkjax.storage.trainer import StepResult
        host = [np.asarray(g, np.float32) for g in grads]
        norm = float(jnp.sqrt(sum(jnp.sum(jnp.square(jnp.asarray(g))) for g in host)))
        t0 = time.perf_counter()
        count = self.tier.committed_step
        scale = clip_scale(self.spec.max_grad_norm, norm)
        hyper = step_hyper(self.spec, count, learning_rate_at(self.spec.learning_rate, count))
        params = {}

        def fn(c, views):
            g = host[c]
            views[3][:] = g  # the fp32 gradient swapped out to storage (read back at the next step's slot)
            out = np.empty(g.size, np.uint16)
            update_(hyper, views[0], views[1:3], np.ascontiguousarray(g), out, scale)
            params[c] = out.view(BF16)

        io = self.tier.update(fn)
        storage = {d: io.read[d] + io.written[d] for d in io.read}
        return StepResult(self.tier.committed_step, [params[c] for c in self.chunk_sizes], False, norm,
                          sum(storage.values()), sum(io.read.values()), sum(io.written.values()), storage,
                          time.perf_counter() - t0, self.n_params, io.emulated)

    def close(self):
        self.tier.close()


# ----------------------------------------------------------------------------------------------
# --mode links
# ----------------------------------------------------------------------------------------------

def _chunk_sizes(n_params: int, chunk: int) -> list[int]:
    full, rest = divmod(n_params, chunk)
    return [chunk] * full + ([rest] if rest else [])


def _make_opt(mode, dirs, sizes, spec, init, link_model, args):
    from chunkjax.storage.near import NearStorageOptimizer
    if mode == "baseline":
        # Read-ahead n/2 (n_dirs + read_ahead + 1 buffers): under the emulated links (4e5 params,
        # 8192-element chunks, scale 2500) 8 dirs took 2.94 s with read-ahead 1, 2.11 s with 4,
        # 2.15 s with 8 (bound 2.0 s); 4 dirs 3.02 s with 1, 2.85 s with 2 (bound 2.67 s).
        return GradOffloadBaseline(dirs, sizes, spec, init, link_model=link_model, fsync=args.fsync,
                                   read_ahead=max(1, len(dirs) // 2))
    return NearStorageOptimizer(dirs, sizes, spec, init_params=init, link_model=link_model,
                                compression="topk" if mode == "near_storage_topk" else None,
                                topk_ratio=args.topk, n_buffers=args.ns_buffers, fsync=args.fsync)


def run_one(mode: str, n: int, link_model, args, root: str) -> dict:
    """Warm-up step + ``args.steps`` timed steps of one mode at ``n`` workers; median times."""
    import ml_dtypes
    import numpy as np

    from chunkjax.host_update import AdamW
    sizes = _chunk_sizes(args.params, args.chunk)
    rng = np.random.default_rng(args.seed)
    init = [rng.standard_normal(s, dtype=np.float32) * np.float32(0.02) for s in sizes]
    spec = AdamW(1e-3, weight_decay=0.0, max_grad_norm=1.0)
    base = tempfile.mkdtemp(prefix=f"{mode}_{n}_", dir=root)
    dirs = [os.path.join(base, f"dev{i}") for i in range(n)]
    t_open = time.perf_counter()
    opt = _make_opt(mode, dirs, sizes, spec, init, link_model, args)
    open_s = time.perf_counter() - t_open
    rows = []
    try:
        for k in range(args.steps + 1):
            g = [rng.standard_normal(s, dtype=np.float32) * np.float32(1e-3) for s in sizes]
            if mode != "baseline":
                g = [a.astype(ml_dtypes.bfloat16) for a in g]
            t0 = time.perf_counter()
            r = opt.step(g)
            dt = time.perf_counter() - t0
            if k > 0:  # step 1 is the warm-up (jit of top-k, page cache, pipes)
                rows.append((dt, r))
    finally:
        opt.close()
        shutil.rmtree(base, ignore_errors=True)
    compress_s = None
    if mode == "near_storage_topk":  # the trainer-side top-k (on the accelerator in the design; CPU here)
        import jax

        from chunkjax.storage.topk import topk_compress_many
        t0 = time.perf_counter()  # as the optimizer does it: one batched top-k per chunk size
        jax.block_until_ready(topk_compress_many(g, args.topk))
        compress_s = time.perf_counter() - t0
    n_params = sum(sizes)
    last = rows[-1][1]
    return {
        "mode": mode, "workers": n, "emulated": bool(link_model is not None and link_model.emulated),
        "n_params": n_params, "n_chunks": len(sizes), "steps_timed": len(rows),
        "shared_link_bytes_per_param": last.shared_link_bytes / n_params,
        "shared_link_in_bytes_per_param": last.shared_link_in / n_params,
        "shared_link_out_bytes_per_param": last.shared_link_out / n_params,
        "storage_link_bytes_per_param": last.storage_link_bytes_per_param,
        "step_s": statistics.median(dt for dt, _ in rows),
        "update_s": statistics.median(r.update_s for _, r in rows),
        "step_s_all": [dt for dt, _ in rows], "update_s_all": [r.update_s for _, r in rows],
        "open_s": open_s, "trainer_topk_compress_s": compress_s,
    }


def run_links(args) -> dict:
    from chunkjax.storage import LinkModel
    root = tempfile.mkdtemp(prefix="bench_storage_", dir=args.storage_dir)
    S, D = PAPER_SHARED_BYTES_PER_S / args.scale, PAPER_DISK_BYTES_PER_S / args.scale
    passes = [("emulated", LinkModel(shared_bytes_per_s=S, disk_bytes_per_s=D))]
    if not args.no_real:
        passes.append(("real", None))
    results = []
    try:
        for pname, lm in passes:
            for n in args.workers:
                by_mode = {}
                for mode in MODES:
                    r = run_one(mode, n, lm, args, root)
                    r["pass"] = pname
                    by_mode[mode] = r
                    print(f"  {pname:8s} n={n} {mode:18s} shared {r['shared_link_bytes_per_param']:6.2f} B/param  "
                          f"update {r['update_s']:.3f}s", flush=True)
                b = by_mode["baseline"]
                for mode, r in by_mode.items():
                    r["speedup"] = b["update_s"] / r["update_s"] if r["update_s"] > 0 else None
                    if lm is None or mode == "baseline":
                        r["bound_speedup"] = None if lm is None else 1.0
                        r["bound_speedup_limit"] = r["bound_speedup_emulated"] = r["bound_speedup"]
                    else:
                        r["bound_speedup_emulated"] = bound_speedup_emulated(n, S, D, r["shared_link_bytes_per_param"])
                        p = NEAR_STORAGE_PAYLOAD if mode == "near_storage" else r["shared_link_bytes_per_param"]
                        r["bound_speedup"] = bound_speedup(n, S, D, p)
                        r["bound_speedup_limit"] = bound_speedup(n, S, D, 0.0 if mode == "near_storage_topk"
                                                                 else NEAR_STORAGE_PAYLOAD)
                    results.append(r)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "kind": "storage_links", "emulated_link_model": {
            "label": "EMULATED: Smart-Infinity's link model, every rate divided by --scale",
            "paper_shared_bytes_per_s": PAPER_SHARED_BYTES_PER_S, "paper_disk_bytes_per_s": PAPER_DISK_BYTES_PER_S,
            "scale": args.scale, "shared_bytes_per_s": S, "disk_bytes_per_s": D},
        "bound_formula": "T_base(n)=max(32/S,32/(nD)); T_ns(n,p)=max(p/S,(24+p)/(nD)); bound=T_base/T_ns "
                         "(p: near-storage shared-link bytes/param; bound_speedup_limit: p=4 near_storage, p->0 topk)",
        "bound_issue_check": {"8": [round(bound_speedup(8), 2), round(bound_speedup(8, payload=0), 2)],
                              "4": [round(bound_speedup(4), 2), round(bound_speedup(4, payload=0), 2)]},
        "results": results,
    }


def links_table(res: dict) -> str:
    lines = ["| pass | workers | mode | shared B/param | storage B/param | step_s | update_s | speedup | bound | "
             "bound (p->0) | bound (emulated topology) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    f = (lambda x: "-" if x is None else f"{x:.2f}")
    for r in res["results"]:
        lines.append(f"| {'emulated' if r['emulated'] else 'real disk'} | {r['workers']} | {r['mode']} | "
                     f"{r['shared_link_bytes_per_param']:.2f} | {r['storage_link_bytes_per_param']:.2f} | "
                     f"{r['step_s']:.3f} | {r['update_s']:.3f} | {f(r['speedup'])} | {f(r['bound_speedup'])} | "
                     f"{f(r['bound_speedup_limit'])} | {f(r['bound_speedup_emulated'])} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# --mode train
# ----------------------------------------------------------------------------------------------

def _schedule(cfg):
    """The main job's learning-rate schedule (``experiments.train.host_spec``'s, the optax reference's too)."""
    from experiments.train import host_spec
    return host_spec(cfg).learning_rate


class _Model:
    """The main job's model, loss, data and validation loss, with params as a flat float32 vector."""

    def __init__(self, cfg):
        import jax
        import jax.numpy as jnp
        import numpy as np

        from experiments import data as data_mod
        from models import gpt
        self.cfg = cfg
        self.mcfg = gpt.get_config(cfg.model)
        if cfg.seq > self.mcfg.seq_len:
            raise UsageError(f"--seq {cfg.seq} exceeds the model's {self.mcfg.seq_len} positions")
        try:
            self.td = data_mod.load_token_data(cfg.tokenizer, cfg.data_cache)
        except data_mod.MissingDataError as e:
            raise UsageError(str(e)) from None
        if self.td.vocab_size > self.mcfg.vocab_size:
            raise UsageError(f"tokenizer {cfg.tokenizer} has {self.td.vocab_size} tokens, model {self.mcfg.name} "
                             f"{self.mcfg.vocab_size}: use --tokenizer with a small vocabulary (bpe<N>)")
        params = gpt.init_params(self.mcfg, jax.random.key(cfg.seed))
        leaves, self.treedef = jax.tree.flatten(params)
        self.shapes = [lf.shape for lf in leaves]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        offsets = np.cumsum([0] + self.sizes)
        j = next(i for i, nm in enumerate(names) if nm.endswith("['wte']"))
        #: the token embedding's elements [start, stop) in the flat params (the tied LM head too)
        self.embedding_range = (int(offsets[j]), int(offsets[j + 1]))
        self.init_flat = np.concatenate([np.asarray(lf, np.float32).ravel() for lf in leaves])
        self.val = data_mod.eval_batches(self.td.val, cfg.batch, cfg.seq, cfg.eval_batches)
        mcfg = self.mcfg

        def unflat(flat):
            out, o = [], 0
            for shp, n in zip(self.shapes, self.sizes):
                out.append(flat[o:o + n].reshape(shp))
                o += n
            return jax.tree.unflatten(self.treedef, out)

        self.unflat = unflat

        @jax.jit
        def loss_grad(flat, batch):  # flat: (P,) float32 (the bf16 params upcast)
            loss, g = jax.value_and_grad(lambda p: gpt.loss_fn(mcfg, p, batch))(unflat(flat))
            return loss, jnp.concatenate([x.ravel() for x in jax.tree.leaves(g)])

        @jax.jit
        def loss_grad_tree(tree, batch):
            return jax.value_and_grad(lambda p: gpt.loss_fn(mcfg, p, batch))(tree)

        self.loss_grad, self.loss_grad_tree = loss_grad, loss_grad_tree
        self.eval_loss = jax.jit(lambda flat, b: gpt.loss_fn(mcfg, unflat(flat), b))

    def batches(self):
        from experiments import data as data_mod
        return data_mod.sample_batches(self.td.train, self.cfg.batch, self.cfg.seq, self.cfg.seed)

    def val_loss(self, flat) -> float:
        """The main job's validation loss: mean over its fixed validation batches (nats)."""
        import numpy as np
        return float(np.mean([float(self.eval_loss(flat, b)) for b in self.val]))


def _bf16_round(x):
    import jax.numpy as jnp
    return jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)


def run_optax_reference(model: _Model, steps: int) -> dict:
    """The main job's optax optimizer in memory on float32 master params, the forward on their bf16
    rounding (the same loop as the near-storage runs). Returns losses and the master after ``steps``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from experiments.train import _optimizer
    tx = _optimizer(model.cfg)
    master = model.unflat(jnp.asarray(model.init_flat))
    state = tx.init(master)
    batches = model.batches()

    @jax.jit  # one program per step (op by op, tx.update compiled ~290 small programs)
    def step(master, state, b):
        loss, g = model.loss_grad_tree(jax.tree.map(_bf16_round, master), b)
        upd, state = tx.update(g, state, master)
        return loss, optax.apply_updates(master, upd), state

    losses = []
    for _ in range(steps):
        loss, master, state = step(master, state, next(batches))
        losses.append(float(loss))
    flat = np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(master)])
    return {"losses": losses, "master": flat}


def _variant_fraction(text: str, variant: str, what: str) -> float:
    """A number in (0, 1] inside a variant name; UsageError (one line) otherwise."""
    try:
        x = float(text)
    except ValueError:
        raise UsageError(f"--variants: unknown variant {variant!r}") from None
    if not 0 < x <= 1:
        raise UsageError(f"--variants {variant!r}: {what} must be in (0, 1]")
    return x


def variant_options(variant: str) -> dict:
    """NearStorageOptimizer options of a train variant: ``uncompressed``, or
    ``topk[_global[_emb<share>]][_ef[<decay>]][_lazy]``: top-k per chunk (the paper) or over the
    whole gradient (``_global``; ``_emb0.5``: half of the kept entries reserved for the token
    embedding, returned as ``embedding_share`` and turned into ``topk_groups`` by the caller), with
    error feedback (``_ef``), its residual decayed by ``<decay>`` each step
    (``_ef0.9``; default 1, classic error feedback), applied by lazy AdamW (``_lazy``: only the
    kept entries step, ``sparse_update="lazy"``). Raises UsageError for other names."""
    if variant == "uncompressed":
        return {"compression": None}
    rest, out = variant, {"compression": "topk"}
    if not rest.startswith("topk"):
        raise UsageError(f"--variants: unknown variant {variant!r} (uncompressed or "
                         "topk[_global[_emb<share>]][_ef[<decay>]][_lazy])")
    if "_emb" in rest and not rest.startswith("topk_global_emb"):
        raise UsageError(f"--variants {variant!r}: _emb<share> needs global top-k: topk_global_emb<share>...")
    rest = rest[4:]
    if rest.startswith("_global"):
        out["topk_scope"], rest = "global", rest[7:]
        if rest.startswith("_emb"):
            num, _, tail = rest[4:].partition("_")
            out["embedding_share"] = _variant_fraction(num, variant, "the embedding's share")
            rest = "_" + tail if tail else ""
    if rest.endswith("_lazy"):
        out["sparse_update"], rest = "lazy", rest[:-5]
    if rest.startswith("_ef"):
        out["error_feedback"], rest = True, rest[3:]
        if rest:
            out["ef_decay"], rest = _variant_fraction(rest, variant, "the residual decay"), ""
    if rest:
        raise UsageError(f"--variants: unknown variant {variant!r} (uncompressed or "
                         "topk[_global[_emb<share>]][_ef[<decay>]][_lazy])")
    return out


def run_near_storage_train(model: _Model, variant: str, args, root: str, compare_at: int | None = None) -> dict:
    """One training run with the update in NearStorageOptimizer workers. ``variant``: see
    :func:`variant_options`. Returns losses, validation losses and (at ``compare_at``) the master params."""
    import jax.numpy as jnp
    import numpy as np

    from chunkjax.host_update import AdamW
    from chunkjax.storage.near import NearStorageOptimizer
    from chunkjax.storage.topk import chunk_ranges
    cfg = model.cfg
    spec = AdamW(_schedule(cfg), weight_decay=cfg.weight_decay, max_grad_norm=cfg.clip if cfg.clip > 0 else None)
    sizes = _chunk_sizes(model.init_flat.size, args.train_chunk)
    bounds = np.cumsum([0] + sizes)
    init = [model.init_flat[bounds[i]:bounds[i + 1]] for i in range(len(sizes))]
    base = tempfile.mkdtemp(prefix=f"train_{variant}_", dir=root)
    dirs = [os.path.join(base, f"dev{i}") for i in range(args.train_workers)]
    options = variant_options(variant)
    share = options.pop("embedding_share", None)
    if share is not None:
        options["topk_groups"] = [(share, chunk_ranges(*model.embedding_range, sizes))]
    opt = NearStorageOptimizer(dirs, sizes, spec, init_params=init, topk_ratio=args.topk, **options,
                               n_buffers=args.ns_buffers, fsync=args.fsync)
    flat = _bf16_round(model.init_flat)
    batches = model.batches()
    losses, vals, shared, master_at = [], [], [], None
    t0 = time.perf_counter()
    try:
        vals.append({"step": 0, "val_loss": model.val_loss(flat)})
        for i in range(1, cfg.steps + 1):
            loss, g = model.loss_grad(flat, next(batches))
            g = np.asarray(g)
            r = opt.step([g[bounds[c]:bounds[c + 1]] for c in range(len(sizes))])
            if r.skipped:
                raise UsageError(f"{variant}: non-finite gradient at step {i}")
            flat = jnp.asarray(np.concatenate([np.asarray(p, np.float32) for p in r.params]))
            losses.append(float(loss))
            shared.append(r.shared_link_bytes_per_param)
            if compare_at == i:
                st = opt.read_state()
                master_at = np.concatenate([st[c][0] for c in range(len(sizes))])
            if i % cfg.eval_every == 0 or i == cfg.steps:
                vals.append({"step": i, "val_loss": model.val_loss(flat)})
                print(f"  {variant}: step {i}/{cfg.steps} loss {losses[-1]:.4f} val {vals[-1]['val_loss']:.4f} "
                      f"({time.perf_counter() - t0:.0f}s)", flush=True)
        st = opt.read_state()
        master = np.concatenate([st[c][0] for c in range(len(sizes))])
        val_master = model.val_loss(jnp.asarray(master))
    finally:
        opt.close()
        shutil.rmtree(base, ignore_errors=True)
    return {"variant": variant, "losses": losses, "val": vals, "val_loss": vals[-1]["val_loss"],
            "val_loss_fp32_master": val_master, "shared_link_bytes_per_param": float(np.median(shared)),
            "shared_link_bytes_per_param_mean": float(np.mean(shared)), "options": variant_options(variant),
            "topk_groups": [[sh, [list(r) for r in rs]] for sh, rs in options.get("topk_groups", [])],
            "wall_s": time.perf_counter() - t0, "n_chunks": len(sizes), "master_at_compare": master_at}


def run_train(args) -> dict:
    import numpy as np

    from experiments.train import TrainConfig, warmup_for
    over = {k: v for k, v in (("model", args.model), ("steps", args.steps), ("seq", args.seq), ("seed", args.seed),
                              ("batch", args.batch), ("tokenizer", args.tokenizer),
                              ("data_cache", args.data_cache)) if v is not None}
    cfg = dataclasses.replace(TrainConfig(), **over)
    cfg = dataclasses.replace(cfg, warmup=warmup_for(cfg))  # the main job's default (-1) resolved, for both runs
    model = _Model(cfg)
    K = min(args.compare_steps, cfg.steps)
    root = tempfile.mkdtemp(prefix="bench_storage_train_", dir=args.storage_dir)
    runs = {}
    try:
        ref = run_optax_reference(model, K) if K > 0 else None
        for variant in args.variants:
            runs[variant] = run_near_storage_train(model, variant, args, root,
                                                   compare_at=K if variant == "uncompressed" else None)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {"kind": "storage_train", "config": dataclasses.asdict(cfg) | {"train_chunk": args.train_chunk,
           "train_workers": args.train_workers, "topk": args.topk, "fsync": args.fsync},
           "n_params": int(model.init_flat.size), "runs": {}}
    u = runs.get("uncompressed")
    for v, r in runs.items():
        r = dict(r)
        r.pop("master_at_compare")
        if u is not None:
            r["val_loss_rel_diff_to_uncompressed"] = (r["val_loss"] - u["val_loss"]) / u["val_loss"]
            r["within_3pct"] = abs(r["val_loss_rel_diff_to_uncompressed"]) <= 0.03
        out["runs"][v] = r
    if ref is not None and u is not None and u["master_at_compare"] is not None:
        a, b = u["master_at_compare"], ref["master"]
        la, lb = np.array(u["losses"][:K]), np.array(ref["losses"])
        out["vs_optax"] = {
            "steps": K, "max_abs_master_diff": float(np.max(np.abs(a - b))),
            "max_abs_master": float(np.max(np.abs(b))),
            "max_rel_master_diff": float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30))),
            "master_equal_fraction": float(np.mean(a == b)),
            "max_abs_loss_diff": float(np.max(np.abs(la - lb))),
            "losses_near_storage": la.tolist(), "losses_optax": lb.tolist(),
            "allclose_rtol1e-5_atol1e-6": bool(np.allclose(a, b, rtol=1e-5, atol=1e-6)),
            "close_fraction_rtol1e-5_atol1e-6": float(np.mean(np.isclose(a, b, rtol=1e-5, atol=1e-6))),
            "max_learning_rate": float(max(_schedule(model.cfg)(i) for i in range(K))),
        }
    return out


SUMMARY_SAME = ("model", "steps", "batch", "seq", "lr", "warmup", "weight_decay", "clip", "train_chunk", "topk")


def run_summary(paths: list[str]) -> dict:
    """Merge train results of several seeds (one ``storage_train_*.json`` per run, any variants):
    per variant, the validation loss of each seed, their mean and sample standard deviation, and
    the relative difference of the mean to the uncompressed mean *over the same seeds* and of each
    seed to its own seed's uncompressed run (paired). Raises UsageError if a file is missing or not a train result,
    or if the files differ in anything but the seed and the variants."""
    import numpy as np
    files = []
    for p in paths:
        try:
            with open(p) as f:
                r = json.load(f)
        except (OSError, ValueError) as e:
            raise UsageError(f"--inputs {p!r}: {e}") from None
        if r.get("kind") != "storage_train":
            raise UsageError(f"--inputs {p!r} is not a --mode train result")
        files.append((p, r))
    base = {k: files[0][1]["config"].get(k) for k in SUMMARY_SAME}
    for p, r in files[1:]:
        diff = [k for k in SUMMARY_SAME if r["config"].get(k) != base[k]]
        if diff:
            raise UsageError(f"--inputs {p!r} differs from {files[0][0]!r} in {', '.join(diff)}: "
                             "merge only runs that differ in seed and variants")
    per: dict = {}
    for p, r in files:
        seed = r["config"]["seed"]
        for v, run in r["runs"].items():
            if seed in per.setdefault(v, {}):
                raise UsageError(f"--inputs: variant {v!r} seed {seed} appears twice ({p!r})")
            per[v][seed] = {"val_loss": run["val_loss"], "shared_link_bytes_per_param":
                            run["shared_link_bytes_per_param"], "file": os.path.basename(p)}
    u = per.get("uncompressed", {})
    out = {"kind": "storage_train_summary", "config": base, "variants": {}}
    for v, seeds in sorted(per.items(), key=lambda kv: (kv[0] != "uncompressed", kv[0])):
        vals = [seeds[s]["val_loss"] for s in sorted(seeds)]
        mean = float(np.mean(vals))
        row = {"seeds": sorted(seeds), "val_loss": vals, "val_loss_mean": mean,
               "val_loss_std": float(np.std(vals, ddof=1)) if len(vals) > 1 else None,
               "shared_link_bytes_per_param": float(np.median([x["shared_link_bytes_per_param"]
                                                               for x in seeds.values()])),
               "files": [seeds[s]["file"] for s in sorted(seeds)]}
        both = [s for s in sorted(seeds) if s in u]
        if both:  # the means over the seeds both have
            umean = float(np.mean([u[s]["val_loss"] for s in both]))
            vmean = float(np.mean([seeds[s]["val_loss"] for s in both]))
            row["mean_rel_diff_to_uncompressed"] = (vmean - umean) / umean
            row["mean_compared_over_seeds"] = both
            row["within_3pct"] = abs(row["mean_rel_diff_to_uncompressed"]) <= 0.03
            paired = [(seeds[s]["val_loss"] - u[s]["val_loss"]) / u[s]["val_loss"] for s in sorted(seeds) if s in u]
            row["paired_rel_diff"] = paired
            row["paired_rel_diff_max"] = max(paired) if paired else None
        out["variants"][v] = row
    return out


def summary_table(res: dict) -> str:
    lines = ["| run | seeds | val loss per seed (nats) | mean | std | mean vs uncompressed | "
             "per seed vs its uncompressed | shared B/param |", "|---|---|---|---|---|---|---|---|"]
    for v, r in res["variants"].items():
        rd, pr, sd = r.get("mean_rel_diff_to_uncompressed"), r.get("paired_rel_diff") or [], r["val_loss_std"]
        lines.append(f"| {v} | {','.join(map(str, r['seeds']))} | {', '.join(f'{x:.4f}' for x in r['val_loss'])} | "
                     f"{r['val_loss_mean']:.4f} | {'-' if sd is None else f'{sd:.4f}'} | "
                     f"{'-' if rd is None else f'{rd * 100:+.2f} %'} | {', '.join(f'{x * 100:+.2f} %' for x in pr)} | "
                     f"{r['shared_link_bytes_per_param']:.2f} |")
    return "\n".join(lines)


def train_table(res: dict) -> str:
    lines = ["| run | val loss (nats, bf16 params) | val loss (fp32 master) | rel. diff to uncompressed | "
             "shared B/param (median) | shared B/param (mean over run) | wall s |", "|---|---|---|---|---|---|---|"]
    for v, r in res["runs"].items():
        rd = r.get("val_loss_rel_diff_to_uncompressed")
        mean = r.get("shared_link_bytes_per_param_mean")
        lines.append(f"| {v} | {r['val_loss']:.4f} | {r['val_loss_fp32_master']:.4f} | "
                     f"{'-' if rd is None else f'{rd * 100:+.2f} %'} | {r['shared_link_bytes_per_param']:.2f} | "
                     f"{'-' if mean is None else f'{mean:.2f}'} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------

def _num(text: str, what: str, lo: float = 0, integer: bool = False):
    try:
        v = float(text)
    except ValueError:
        raise UsageError(f"{what} {text!r} is not a number") from None
    if not math.isfinite(v) or v <= lo or (integer and v != int(v)):
        raise UsageError(f"{what} {text!r}: must be {'an integer ' if integer else ''}> {lo}")
    return int(v) if integer else v


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m experiments.bench_storage", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="links", help="links (default) | train | summary (merge train results of "
                                                    "several seeds, --inputs)")
    ap.add_argument("--inputs", default="", help="summary: storage_train_*.json files, comma-separated")
    ap.add_argument("--workers", default="1,2,4,8", help="links: worker (storage directory) counts, comma-separated")
    ap.add_argument("--params", default="4e6", help="links: synthetic model size (float32 params)")
    ap.add_argument("--chunk", default="65536", help="links: elements per chunk")
    ap.add_argument("--steps", default=None, help="links: timed steps (default 3, median); train: optimizer steps "
                                                  "(default: the main job's 300)")
    ap.add_argument("--scale", default="100", help="links: divide the paper's 16 GB/s shared and 3 GB/s per-device "
                                                   "rates by this (emulated pass)")
    ap.add_argument("--no-real", action="store_true", help="links: skip the unthrottled real-disk pass")
    ap.add_argument("--topk", default="0.01", help="top-k ratio of near_storage_topk (default 0.01)")
    ap.add_argument("--ns-buffers", default="3", help="staging buffers per near-storage worker")
    ap.add_argument("--fsync", action=argparse.BooleanOptionalAction, default=True,
                    help="fsync chunk files and manifests at each commit (default on)")
    ap.add_argument("--seed", default="0", help="links: random init/gradients seed; train: the main job's seed "
                                                 "(init and data order)")
    ap.add_argument("--model", default=None, help="train: model (default: the main job's)")
    ap.add_argument("--seq", default=None, help="train: tokens per sequence (default: the main job's)")
    ap.add_argument("--batch", default=None, help="train: sequences per step (default: the main job's)")
    ap.add_argument("--tokenizer", default=None, help="train: tokenizer (default: the main job's)")
    ap.add_argument("--data-cache", default=None, help="train: token cache folder (default: the main job's)")
    ap.add_argument("--train-chunk", default="65536", help="train: elements per chunk")
    ap.add_argument("--train-workers", default="2", help="train: near-storage workers (directories)")
    ap.add_argument("--compare-steps", default="20", help="train: steps compared with in-memory optax (0: skip)")
    ap.add_argument("--variants", default="uncompressed,topk_global_emb0.5,topk_global_emb0.5_ef0.9",
                    help="train: runs, comma-separated: uncompressed, or "
                         "topk[_global[_emb<share>]][_ef[<decay>]][_lazy] (top-k per chunk or over the whole "
                         "gradient, <share> of the kept entries for the token embedding, error feedback with its "
                         "residual decayed by <decay>, lazy AdamW on the kept entries only)")
    ap.add_argument("--storage-dir", default=None, help="where chunk files go (default: the system temp folder)")
    ap.add_argument("--run-id", default=None, help="results file suffix (default: UTC time)")
    ap.add_argument("--results-dir", default="experiments/results", help="JSON goes here")
    ap.add_argument("--docs", default=DOCS, help="markdown file whose section is (re)written ('' to skip)")
    a = ap.parse_args(argv)
    if a.mode not in ("links", "train", "summary"):
        raise UsageError(f"--mode {a.mode!r}: use links, train or summary")
    a.inputs = [x for x in a.inputs.split(",") if x]
    if a.mode == "summary" and not a.inputs:
        raise UsageError("--mode summary needs --inputs a.json,b.json (results of --mode train)")
    if a.model is not None:
        from models import gpt
        try:
            gpt.get_config(a.model)
        except ValueError as e:
            raise UsageError(f"--model: {e}") from None
    if a.data_cache is not None and not os.path.isdir(os.path.dirname(os.path.abspath(a.data_cache))):
        raise UsageError(f"--data-cache {a.data_cache!r}: its parent folder does not exist")
    try:
        a.workers = [int(w) for w in a.workers.split(",")]
    except ValueError:
        raise UsageError(f"--workers {a.workers!r}: use comma-separated integers like 1,2,4,8") from None
    if not a.workers or min(a.workers) < 1:
        raise UsageError("--workers: every count must be >= 1")
    a.params = _num(a.params, "--params", 0)
    a.params = int(a.params)
    a.chunk = _num(a.chunk, "--chunk", 0, integer=True)
    if a.steps is not None:
        a.steps = _num(a.steps, "--steps", 0, integer=True)
    a.scale = _num(a.scale, "--scale", 0)
    a.topk = _num(a.topk, "--topk", 0)
    if a.topk > 1:
        raise UsageError(f"--topk {a.topk}: a ratio in (0, 1]")
    a.ns_buffers = _num(a.ns_buffers, "--ns-buffers", 2, integer=True)
    a.seed = _num(a.seed, "--seed", -1, integer=True)
    a.train_chunk = _num(a.train_chunk, "--train-chunk", 0, integer=True)
    a.train_workers = _num(a.train_workers, "--train-workers", 0, integer=True)
    a.compare_steps = _num(a.compare_steps, "--compare-steps", -1, integer=True)
    for what in ("seq", "batch"):
        if getattr(a, what) is not None:
            setattr(a, what, _num(getattr(a, what), f"--{what}", 0, integer=True))
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    if len(set(a.variants)) < len(a.variants):
        raise UsageError(f"--variants {','.join(a.variants)}: a variant is named twice (each runs once)")
    if not a.variants:
        raise UsageError("--variants: name at least one run (uncompressed, topk, topk_ef, topk_global, ...)")
    for v in a.variants:
        variant_options(v)
    if a.params < a.chunk and a.mode == "links":
        a.chunk = a.params
    if a.storage_dir is not None and not os.path.isdir(a.storage_dir):
        raise UsageError(f"--storage-dir {a.storage_dir!r} is not a folder")
    if a.mode == "links" and a.steps is None:
        a.steps = 3
    a.run_id = a.run_id or datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    if not a.run_id.replace("-", "").replace("_", "").isalnum():
        raise UsageError(f"--run-id {a.run_id!r}: letters, digits, - and _ only")
    return a


def write_docs_section(path: str, key: str, body: str):
    """Replace (or append) the section between ``<!-- bench_storage:key -->`` markers of ``path``."""
    from experiments.report import replace_marked_section
    start, end = f"<!-- bench_storage:{key} -->", f"<!-- /bench_storage:{key} -->"
    replace_marked_section(path, start, end, f"{start}\n{body.rstrip()}\n{end}", "# Storage tier (issue 6)\n")


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        os.makedirs(args.results_dir, exist_ok=True)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: --results-dir: {e.strerror}", file=sys.stderr)
        return 2
    cmd = "python -m experiments.bench_storage " + " ".join(sys.argv[1:] if argv is None else argv)
    t0 = time.time()
    try:
        res = {"links": run_links, "train": run_train, "summary": lambda a: run_summary(a.inputs)}[args.mode](args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import platform
    res.update({"command": cmd, "run_id": args.run_id, "wall_s": time.time() - t0, "cpu_count": os.cpu_count(),
                "host": platform.node(), "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat()})
    name = {"links": f"storage_{args.run_id}.json", "train": f"storage_train_{args.run_id}.json",
            "summary": f"storage_train_summary_{args.run_id}.json"}[args.mode]
    path = os.path.join(args.results_dir, name)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    table = {"links": links_table, "train": train_table, "summary": summary_table}[args.mode](res)
    print(table)
    print(f"results: {path}")
    if args.docs:
        if args.mode == "links":
            em = res["emulated_link_model"]
            body = (f"### Links: baseline vs near storage ({args.run_id})\n\n`{cmd}`\n\n"
                    f"Rows marked *emulated* are an **emulation** of the paper's link model: "
                    f"{em['disk_bytes_per_s'] / 1e6:g} MB/s per storage device behind one "
                    f"{em['shared_bytes_per_s'] / 1e6:g} MB/s shared link (3 GB/s and 16 GB/s divided by "
                    f"{em['scale']:g}); *real disk* rows are unthrottled on this machine's disk "
                    f"({os.cpu_count()} CPU cores). speedup = baseline update_s / this update_s at the same "
                    f"worker count; bound = `{res['bound_formula']}`. Results: `{path}`.\n\n{table}\n")
        elif args.mode == "summary":
            c = res["config"]
            body = (f"### Top-k over several seeds ({args.run_id})\n\n`{cmd}`\n\n"
                    f"Model {c['model']}, {c['steps']} steps, batch {c['batch']}, seq {c['seq']}, top-k ratio "
                    f"{c['topk']}; one `--mode train` run per seed, merged. \"mean vs uncompressed\" compares "
                    f"the means over the seeds both ran; \"per seed\" compares each run with the uncompressed run "
                    f"of its own "
                    f"seed (same init and data). Results: `{path}`.\n\n{table}\n")
        else:
            vo = res.get("vs_optax")
            body = (f"### Training with the optimizer on storage ({args.run_id})\n\n`{cmd}`\n\n"
                    f"Model {res['config']['model']} ({res['n_params']:,} params), {res['config']['steps']} steps, "
                    f"batch {res['config']['batch']}, seq {res['config']['seq']}; validation loss as the main job "
                    f"(mean over {res['config']['eval_batches']} validation batches), on the bf16 params the "
                    f"workers return and on the fp32 master read back from storage. Results: `{path}`.\n\n"
                    f"{table}\n")
            if vo:
                body += (f"\nUncompressed near storage vs in-memory optax after {vo['steps']} steps: max |master "
                         f"diff| {vo['max_abs_master_diff']:.3g} (max |master| {vo['max_abs_master']:.3g}), "
                         f"{vo['master_equal_fraction'] * 100:.2f} % of master params bit-equal, max |loss diff| "
                         f"{vo['max_abs_loss_diff']:.3g}.\n")
        write_docs_section(args.docs, f"{args.mode}", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
