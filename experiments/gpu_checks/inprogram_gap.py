"""Issue 24: the compiled device peak of in-program accumulation against its accounting, per program.

    python experiments/gpu_checks/inprogram_gap.py                      # GPU: GPT3_15B's block shape, 6 layers, 8 x 8 x 1024
    python experiments/gpu_checks/inprogram_gap.py --d 256 --heads 4 --layers 4 --vocab 2048 --seq 128 --rows 4  # CPU

A GPT (d_model ``--d``, ``--layers`` blocks) is planned twice on this machine's traces at ``--frac`` of the
way from the smallest plan (every chunk offloaded) to the all-device one: one micro-batch of ``--rows`` x
``--seq``, and ``--m`` of them (in-program accumulation: :mod:`chunkjax.plan_micro`). Every program of each
plan is compiled (:func:`chunkjax.fit.compiled_peak`, nothing allocated, the step's donation; on the CPU
donation is forced on as on a GPU) and its figure (argument + output + temp - alias + held beside + the
device-updated chunks' state) printed beside the accounted peak of its moments. For the in-program plan it
also prints each stage's loop figure (:func:`chunkjax.trace.in_program_traces`, measured) beside the old
estimate (one micro-batch's internals + (M - 1) x (input + output)). Before the fix the H200's GPT3_15B b64
compiled 7.1-9.5 % over its accounting; one micro-batch plans compile within ~0.5 %. JSON: ``$OUT/inprogram_gap.json``
(``--tag`` names it ``inprogram_gap_<tag>.json``). Each row also has ``plan_s`` and ``compile_s`` (the seconds
of the plans and of compiling every program, and ``xla_flags``): on the H200 GPT3_18B's 32 in-program programs
(8 x 1 x 1024) compiled and checked for ~380 s where its one-micro-batch plan's took ~34 s (s19b2, s17b), so
``--rows 1 --m 8`` under different ``XLA_FLAGS`` (e.g. ``--xla_gpu_autotune_level=0``,
``--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_NO_UNROLL``) says where the time goes.
On the CPU compile with ``XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander`` (tests/test_lora.py says why).
``--segments 0,3,6,10`` forces the in-program plan's programs (several looped backward moments in one: issue 24's
hoisted loop buffers, gone since the loops are tied, :mod:`chunkjax.tied_loop`).
"""
import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def run(a) -> list:
    import jax
    import jax.numpy as jnp

    from chunkjax import fit, predict
    from chunkjax.host_update import AdamW
    from chunkjax.plan_micro import grouped_problem
    from chunkjax.step import ChunkedStep
    from chunkjax.trace import in_program_traces
    from models import gpt
    if a.no_loop_extra and hasattr(predict, "loop_init_extra"):
        predict.loop_init_extra = lambda traces, tide, segments: [0] * len(tide.moments)
    if jax.default_backend() == "cpu":  # a GPU donates the programs' carries; the CPU does not by default
        ChunkedStep._donates = property(lambda self: True)
    cfg = dataclasses.replace(gpt.get_config("micro"), d_model=a.d, n_layers=a.layers, n_heads=a.heads,
                              vocab_size=a.vocab, seq_len=a.seq)
    rows = []
    for m in ((a.m,) if a.in_program_only else (1, a.m)):
        batch = jax.ShapeDtypeStruct((m * a.rows, a.seq + 1), jnp.int32)
        t_plan = time.perf_counter()  # the traces (in-program: each stage's loop compiled) and the plans
        p = fit.prepare(gpt.gpt_stages(cfg), gpt.abstract_params(cfg), batch, host_optimizer=AdamW(1e-4),
                        compute_dtype=jnp.bfloat16, micro_batches=m, check_host=False, host_budget=None)
        if a.segments and m > 1:
            p = dataclasses.replace(p, segments=tuple(int(v) for v in a.segments.split(",")))
        try:
            fit.plan(p, 1)
            floor = 1
        except fit.PlanError as e:
            floor = e.min_budget_bytes
        full = fit.plan(p, 1 << 50).predicted.peak_device_bytes
        s = fit.plan(p, int(floor + a.frac * (full - floor)))
        step = fit.build_step(p, s)
        t_compile = time.perf_counter()
        mem = fit.compiled_peak(p, step, s)
        t_done = time.perf_counter()
        pm = s.predicted.device_bytes_per_moment
        row = {"micro_batches": m, "accumulation": s.accumulation, "counts": s.counts(),
               "chunk_size": p.layout.chunk_size, "accounted_peak": int(s.predicted.peak_device_bytes),
               "compiled_peak": int(mem["peak_bytes"]), "ratio": mem["peak_bytes"] / s.predicted.peak_device_bytes,
               "plan_s": t_compile - t_plan, "compile_s": t_done - t_compile, "n_programs": len(step.program_bounds()),
               "xla_flags": os.environ.get("XLA_FLAGS", ""), "programs": []}
        print(f"M={m} {s.accumulation} {s.counts()}: accounted {row['accounted_peak']} compiled {row['compiled_peak']} "
              f"ratio {row['ratio']:.4f}; plan {row['plan_s']:.1f} s, compile of {row['n_programs']} programs "
              f"{row['compile_s']:.1f} s", flush=True)
        for k, ((t0, t1), q) in enumerate(zip(step.program_bounds(), mem["programs"])):
            acc = max(pm[t0:t1])
            comp = q["peak_device_bytes"] + q["beside_bytes"] + mem["resident_state_bytes"]
            row["programs"].append(dict(q, moments=[t0, t1], accounted=int(acc), compiled=int(comp)))
            print(f"  program {k} moments [{t0},{t1}): accounted {acc} compiled {comp} ({comp - acc:+d}); argument "
                  f"{q['argument']} output {q['output']} temp {q['temp']} alias {q['alias']} beside {q['beside_bytes']}")
        if m > 1:
            est, meas = in_program_traces(p.traces, m), grouped_problem(p, m).traces
            row["stages"] = [{"name": t.name, "one_micro_batch": t.temp_bytes, "estimate": e.temp_bytes,
                              "measured": u.temp_bytes} for t, e, u in zip(p.traces, est, meas)]
            for r in row["stages"]:
                print(f"  stage {r['name']}: one micro-batch {r['one_micro_batch']} estimate {r['estimate']} "
                      f"measured loop {r['measured']}")
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=8, help="rows per micro-batch")
    ap.add_argument("--m", type=int, default=8, help="micro-batches looped in-program")
    ap.add_argument("--frac", type=float, default=0.6)
    ap.add_argument("--segments", default="", help="program starts forced on the in-program plan, e.g. 0,3,6,10 "
                    "(several looped backward moments a program: where XLA used to fill later loops early)")
    ap.add_argument("--in-program-only", action="store_true", help="skip the one-micro-batch plan")
    ap.add_argument("--no-loop-extra", action="store_true", help="account without predict.loop_init_extra "
                    "(the old code's; gone since the loops are tied)")
    ap.add_argument("--tag", default="", help="the JSON's name: inprogram_gap_<tag>.json")
    a = ap.parse_args(argv)
    rows = run(a)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"inprogram_gap{'_' + a.tag if a.tag else ''}.json"), "w") as fh:
            json.dump({"args": vars(a), "rows": rows}, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
