"""Issue 9: the peers (DeepSpeed ZeRO-Offload / ZeRO-Infinity) on the same GPU, model, batch,
sequence length and device budget as :mod:`experiments.bench`, with ratios against chunkjax.

    python -m experiments.peers.run_peers --model GPT2_1B --batch 16 --device-budget 104.6GiB \\
        --systems ds_zero_offload --run-id p1_gpt2 --chunkjax-json experiments/results/bench_s5_gpt2_overhead.json
    python -m experiments.peers.run_peers --report experiments/results/peers_p1_gpt2.json

Each peer runs in its own process (:mod:`experiments.peers.deepspeed_gpt`, killed after
``--worker-timeout`` seconds); the JAX matmul probe of the bench runs first in the same call, so
``mfu`` uses the same rate as chunkjax's rows (each peer also reports ``mfu_torch_matmul``, against
torch's own bf16 matmul rate measured in its process). ``--chunkjax-json`` names a bench results
file of the same model, batch, seq and budget: its chunkjax row (and plain_jax's, if present) is
copied into ``reference`` with its source, and ``ratios`` gives chunkjax tokens/s over each
peer's. A peer that fails (out of memory, host memory, a build error) is recorded with
``feasible: false`` and its error. Results: ``<results-dir>/peers_<run_id>.json``; a run may
span several calls (systems merge).

DeepSpeed is not a dependency of chunkjax: the GPU image has torch and transformers, and
``make peer-wheels`` (on a machine with network) puts DeepSpeed 0.19.8 and its missing
dependencies as wheels under ``carry/peer_wheels``; install them there with
``pip install --no-index --no-deps --target /tmp/site carry/peer_wheels/*.whl`` and put
``/tmp/site`` on ``PYTHONPATH`` (experiments/peers/README.md).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

from experiments.bench import load_results, parse_bytes, write_json_atomic
from experiments.peers.common import PEERS, peer_record

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(cmd, env, timeout):
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout or None, cwd=REPO)
        return p.returncode, p.stdout, p.stderr, False, time.time() - t0
    except subprocess.TimeoutExpired as e:
        dec = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        return 124, dec(e.stdout), dec(e.stderr), True, time.time() - t0


def run_peer(system: str, args, budget: int) -> dict:
    """One peer in its own process; returns its record (``feasible: false`` and the tail of its
    stderr when the process died or timed out)."""
    fd, out = tempfile.mkstemp(prefix="peer_", suffix=".json")
    os.close(fd)
    os.unlink(out)
    cmd = [sys.executable, "-m", "experiments.peers.deepspeed_gpt", "--system", system, "--model", args.model,
           "--batch", str(args.batch), "--seq", str(args.seq), "--budget-bytes", str(budget), "--steps",
           str(args.steps), "--out", out] + (["--nvme-dir", args.nvme_dir] if args.nvme_dir else [])
    rc, so, se, timed_out, wall = _run(cmd, dict(os.environ), args.worker_timeout)
    rec = None
    if os.path.exists(out):
        with open(out) as fh:
            rec = json.load(fh)
        os.unlink(out)
    if rec is None:
        prog = [json.loads(l) for l in se.splitlines() if l.startswith('{"peer_progress"')]
        rec = {"system": system, "model": args.model, "batch": args.batch, "seq": args.seq,
               "device_budget_bytes": budget, "feasible": False,
               "error": ("timed out after %ss" % args.worker_timeout) if timed_out else f"process exited with {rc}",
               "losses": [p["loss"] for p in prog], "step_s_all": [p["s"] for p in prog[1:]]}
    rec["stderr_tail"] = [l for l in se.strip().splitlines() if not l.startswith('{"peer_progress"')][-15:]
    rec["rc"], rec["timed_out"], rec["process_wall_s"] = rc, timed_out, wall
    return rec


def jax_matmul_probe(matmul_n: int) -> dict:
    """The bench's matmul probe (``python -m experiments.bench --probe``) in its own process."""
    rc, so, se, _, _ = _run([sys.executable, "-m", "experiments.bench", "--probe", "--matmul-n", str(matmul_n)],
                            dict(os.environ), 600)
    try:
        return json.loads(so.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": (se.strip().splitlines() or ["no output"])[-1]}


def reference_rows(bench_json: str | None, model: str, batch: int, seq: int, budget: int) -> dict:
    """chunkjax's (and plain_jax's) rows from a bench results file of the same setting.

    Raises:
      ValueError: the file holds another model, batch, seq or budget.
    """
    if not bench_json:
        return {}
    res = load_results(bench_json)
    if res is None:
        raise ValueError(f"--chunkjax-json {bench_json}: no such results file")
    for k, v in (("model", model), ("batch", batch), ("seq", seq), ("device_budget_bytes", budget)):
        if res.get(k) != v:
            raise ValueError(f"--chunkjax-json {bench_json} holds {k}={res.get(k)!r}, this run {v!r}: "
                             "give a bench run of the same setting")
    keys = ("tokens_per_s", "mfu", "tflops", "peak_device_bytes_measured", "step_s_median", "feasible", "losses")
    out = {}
    for name in ("chunkjax", "plain_jax"):
        r = res["systems"].get(name)
        if r:
            out[name] = {k: r.get(k) for k in keys}
            out[name]["source"] = os.path.relpath(os.path.abspath(bench_json), REPO)
            out[name]["matmul_tflops"] = r.get("matmul_tflops") or res.get("matmul_tflops")
    return out


def ratios(results: dict) -> dict:
    """chunkjax tokens/s over each feasible peer's (``None`` where either is missing)."""
    cj = ((results.get("reference") or {}).get("chunkjax") or {}).get("tokens_per_s")
    out = {}
    for name, rec in results["systems"].items():
        tps = rec.get("tokens_per_s") if rec.get("feasible") else None
        out[name] = (cj / tps) if (cj and tps) else None
    return out


def render_markdown(results: dict, results_file: str) -> str:
    """The run's section of docs/benchmarks.md (between ``<!-- peers:<run_id>:... -->`` markers)."""
    rid = results["run_id"]
    gib = results["device_budget_bytes"] / 2 ** 30
    lines = [f"<!-- peers:{rid}:start -->", f"### Peers `{rid}`: {results['model']}, batch {results['batch']} x "
             f"{results['seq']}, device budget {gib:.1f} GiB", "",
             f"Results: `{results_file}`. JAX matmul probe {results.get('matmul_tflops') or float('nan'):.0f} TFLOP/s "
             "in the same call. Commands:", ""]
    lines += [f"    {c}" for c in results.get("commands", [])]
    lines += ["", "| system | feasible | tokens/s | TFLOP/s | MFU | MFU vs torch matmul | step s | peak device GB | "
                  "start-up s | chunkjax / system |", "|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda v, d=2, s=1.0: "-" if v is None else f"{v / s:,.{d}f}"
    rat = results.get("ratios", {})
    for name, r in (results.get("reference") or {}).items():
        lines.append(f"| {name} (`{r.get('source')}`) | {r.get('feasible')} | {f(r.get('tokens_per_s'), 0)} | "
                     f"{f(r.get('tflops'), 0)} | {f(r.get('mfu'), 3)} | - | {f(r.get('step_s_median'), 3)} | "
                     f"{f(r.get('peak_device_bytes_measured'), 2, 1e9)} | - | - |")
    for name, r in results["systems"].items():
        why = "" if r.get("feasible") else f" ({(r.get('error') or '')[:160]})"
        lines.append(f"| {name}{why} | {r.get('feasible')} | {f(r.get('tokens_per_s'), 0)} | {f(r.get('tflops'), 0)} | "
                     f"{f(r.get('mfu'), 3)} | {f(r.get('mfu_torch_matmul'), 3)} | {f(r.get('step_s_median'), 3)} | "
                     f"{f(r.get('peak_device_bytes_measured'), 2, 1e9)} | {f(r.get('init_s'), 0)} | "
                     f"{'-' if rat.get(name) is None else f'{rat[name]:.2f}x'} |")
    lines += ["", *[f"- `{k}`: {PEERS[k]}" for k in results["systems"] if k in PEERS],
              f"<!-- peers:{rid}:end -->", ""]
    return "\n".join(lines)


def update_docs(results_file: str, docs_path: str = "docs/benchmarks.md") -> str:
    """Write or replace the run's section in ``docs_path``; returns it."""
    results = load_results(results_file)
    rel = os.path.relpath(os.path.abspath(results_file), REPO)
    section = render_markdown(results, rel)
    from experiments.report import replace_marked_section
    rid = results["run_id"]
    replace_marked_section(docs_path, f"<!-- peers:{rid}:start -->", f"<!-- peers:{rid}:end -->", section)
    return section


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description="DeepSpeed peers side by side with chunkjax (issue 9)")
    ap.add_argument("--model", default="GPT2_1B")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--device-budget", default="24GiB")
    ap.add_argument("--systems", default="ds_zero_offload", help=f"comma-separated: {', '.join(PEERS)}")
    ap.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up (default: 4)")
    ap.add_argument("--run-id", default=None)
    ap.add_argument("--results-dir", default="experiments/results")
    ap.add_argument("--worker-timeout", type=float, default=0, help="seconds per peer process, 0: none")
    ap.add_argument("--matmul-n", type=int, default=8192)
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--chunkjax-json", default=None, help="bench results of the same setting (for the ratios)")
    ap.add_argument("--report", default=None, metavar="JSON", help="only write the docs section of a results file")
    ap.add_argument("--docs", default="docs/benchmarks.md")
    args = ap.parse_args(argv)
    try:
        if args.report:
            if not os.path.exists(args.report):
                raise ValueError(f"--report {args.report}: no such file")
            print(update_docs(args.report, args.docs))
            return 0
        from models import gpt
        gpt.get_config(args.model)  # an unknown model: ValueError naming the known ones
        systems = [s for s in args.systems.split(",") if s]
        bad = [s for s in systems if s not in PEERS]
        if bad or not systems:
            raise ValueError(f"--systems {args.systems!r}: choose from {', '.join(PEERS)}")
        budget = parse_bytes(args.device_budget)
        ref = reference_rows(args.chunkjax_json, args.model, args.batch, args.seq, budget)
        if not args.run_id:
            raise ValueError("--run-id is required (results go to peers_<run_id>.json)")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = os.path.join(args.results_dir, f"peers_{args.run_id}.json")
    res = load_results(path) or {"run_id": args.run_id, "model": args.model, "batch": args.batch, "seq": args.seq,
                                 "device_budget_bytes": budget, "commands": [], "calls": [], "systems": {}}
    if (res["model"], res["batch"], res["seq"], res["device_budget_bytes"]) != (args.model, args.batch, args.seq, budget):
        print(f"error: run {args.run_id!r} holds another setting: use a new --run-id", file=sys.stderr)
        return 2
    probe = jax_matmul_probe(args.matmul_n)
    print(f"[peers] JAX matmul {probe.get('matmul_tflops')} TFLOP/s", flush=True)
    command = "python -m experiments.peers.run_peers " + " ".join(argv)
    res["commands"] = sorted(set(res["commands"]) | {command})
    res["calls"].append({"time": datetime.datetime.now().isoformat(timespec="seconds"), "probe": probe,
                         "command": command})
    rates = [c["probe"].get("matmul_tflops") for c in res["calls"] if c["probe"].get("matmul_tflops")]
    res["matmul_tflops"] = sorted(rates)[len(rates) // 2] if rates else None
    if ref:
        res["reference"] = ref
    for s in systems:
        rec = run_peer(s, args, budget)
        res["systems"][s] = peer_record(rec, probe.get("matmul_tflops"))
        print(f"[peers] {s}: feasible={rec.get('feasible')} tokens/s={rec.get('tokens_per_s')} "
              f"error={(rec.get('error') or '')[:300]}", flush=True)
        res["ratios"] = ratios(res)
        os.makedirs(args.results_dir, exist_ok=True)
        write_json_atomic(path, res)
    print(f"[peers] wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
