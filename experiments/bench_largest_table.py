"""The models-by-system table of the largest model each system trains on this box (issue 24):
chunkjax from host RAM alone, chunkjax with the disk tier, DeepSpeed ZeRO-Offload and
ZeRO-Infinity, read from the JSON records under ``experiments/results/`` (``bench_*.json`` of
:mod:`experiments.bench`, including its ``--largest`` blocks, and ``peers_*.json`` of the
DeepSpeed runs) and written between the markers ``<!-- largest_table:start -->`` and
``<!-- largest_table:end -->`` of ``docs/benchmarks.md`` (appended once when they are missing).

A model *trains* when its run was feasible with finite losses falling from the first step. Only
runs at batch 8 x 1024 count (the issue's setting). A system with no such run says "not
measured": no number is made up.

    python -m experiments.bench_largest_table [--results-dir experiments/results] [--doc docs/benchmarks.md]
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os

from experiments.report import replace_marked_section
from models import gpt

#: (row label, how a record is recognised) in table order.
ROWS = (("chunkjax, host RAM only", "chunkjax_host"),
        ("chunkjax with the disk tier (`--storage`)", "chunkjax_disk"),
        ("DeepSpeed ZeRO-Offload (stage 2, CPU Adam)", "ds_zero_offload"),
        ("DeepSpeed ZeRO-Infinity (stage 3, params + optimizer on CPU)", "ds_zero_infinity"))
BATCH, SEQ = 8, 1024
START, END = "<!-- largest_table:start -->", "<!-- largest_table:end -->"


def _trains(rec: dict) -> bool:
    losses = [x for x in rec.get("losses") or [] if x is not None]
    finite = rec.get("losses_finite", bool(losses) and all(math.isfinite(x) for x in losses))
    falling = rec.get("loss_falling", len(losses) >= 2 and losses[-1] < losses[0])
    return bool(rec.get("ok", rec.get("feasible") and not rec.get("error") and finite and falling))


def _kind(system: str, rec: dict) -> str | None:
    if system == "chunkjax":
        st = rec.get("storage") or (rec.get("extra") or {}).get("storage") or {}
        return "chunkjax_disk" if st.get("storage_chunks") else "chunkjax_host"
    return system if system in ("ds_zero_offload", "ds_zero_infinity") else None


def collect(results_dir: str) -> dict[str, list[dict]]:
    """``{row kind: [run, ...]}``: every run at batch 8 x 1024 of a table system, each
    ``{"model", "n_params", "trains", "tokens_per_s", "why", "budget", "run"}`` (``budget``: the
    device budget, bytes)."""
    out: dict[str, list[dict]] = {k: [] for _, k in ROWS}
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(d, dict):
            continue
        run = os.path.basename(path)[:-5]
        recs = [(s, dict(r, device_budget_bytes=r.get("device_budget_bytes", d.get("device_budget_bytes"))),
                 r.get("batch", d.get("batch")), r.get("seq", d.get("seq")))
                for s, r in (d.get("systems") or {}).items() if isinstance(r, dict)]
        for s, block in (d.get("largest") or {}).items():
            for m, r in (block.get("tried") or {}).items():
                recs.append((s, dict(r, model=m, device_budget_bytes=block.get("device_budget_bytes")),
                             block.get("batch"), block.get("seq")))
        for s, r, b, q in recs:
            kind = _kind(s, r)
            if kind is None or (b, q) != (BATCH, SEQ) or not r.get("model"):
                continue
            try:
                n = gpt.get_config(r["model"]).n_params
            except ValueError:
                continue
            why = r.get("infeasible_reason") or r.get("error") or ""
            if "-9" in str(why):
                why = "killed by the kernel, host out of memory (exit -9)"
            out[kind].append({"model": r["model"], "n_params": n, "trains": _trains(r),
                              "tokens_per_s": r.get("tokens_per_s"), "why": str(why).split("\n")[0][:160],
                              "budget": r.get("device_budget_bytes") or 0, "run": run})
    return out


def table(runs: dict[str, list[dict]]) -> str:
    """The markdown table (one row per system)."""
    lines = [f"Largest model that trains on this box (one H200, 125 GiB host RAM, local disk), batch "
             f"{BATCH} x {SEQ}, from the records under `experiments/results/` "
             "(`python -m experiments.bench_largest_table` writes this section).", "",
             "| system | largest that trains | next size up tried | runs |", "|---|---|---|---|"]
    for label, kind in ROWS:
        rs = runs.get(kind) or []
        ok = [r for r in rs if r["trains"]]
        if not rs:
            lines.append(f"| {label} | not measured | not measured | |")
            continue
        best = max(ok, key=lambda r: (r["n_params"], r["tokens_per_s"] or 0)) if ok else None
        # the smallest model above the best that did not train, its run with the largest device budget
        above = sorted((r for r in rs if not r["trains"] and (best is None or r["n_params"] > best["n_params"])),
                       key=lambda r: (r["n_params"], -r["budget"]))
        cell = "none" if best is None else (
            f"{best['model']} ({best['n_params'] / 1e9:.2f} B params)"
            + (f", {best['tokens_per_s']:,.0f} tokens/s" if best["tokens_per_s"] else ""))
        nxt = ("not measured" if not above else
               f"{above[0]['model']} ({above[0]['n_params'] / 1e9:.2f} B): {above[0]['why'] or 'did not train'}")
        used = sorted({r["run"] for r in ([best] if best else []) + above[:1]})
        lines.append(f"| {label} | {cell} | {nxt} | {', '.join(f'`{u}`' for u in used)} |")
    return "\n".join(lines) + "\n"


def write(doc: str, text: str) -> None:
    """Replace the marked section of ``doc`` with ``text`` (appended, under its heading, if missing)."""
    with open(doc) as f:
        heading = "" if START in f.read() else "## Largest model by system (issue 24)\n\n"
    # the heading goes before the start marker: a rerun replaces only what lies between the markers
    replace_marked_section(doc, heading + START, END, f"{heading}{START}\n{text}{END}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench_largest_table", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results-dir", default="experiments/results")
    ap.add_argument("--doc", default="docs/benchmarks.md")
    args = ap.parse_args(argv)
    text = table(collect(args.results_dir))
    write(args.doc, text)
    print(text, end="")


if __name__ == "__main__":
    main()
