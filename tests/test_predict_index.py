"""The planner's per-chunk indexing helpers against their definitions, on random schedules.

Session 22: GPT3_18B's plan (364 chunks, in-program micro-batches) spent 46 % of its 889 s in
``grad_done_moments`` (moments x chunks per call, 67,564 calls); the helpers now index by stage and
program (bisect). Each is checked here against the brute-force definition it replaced, exactly
(same values, same order), on 2,000 random traces, tides, program cuts and placements."""
import random
import types

from chunkjax import cross_step
from chunkjax import predict as pr
from chunkjax.memory import DEVICE, PINNED_HOST
from chunkjax.schedule import DEVICE_UPDATE, HOST_UPDATE, STREAMED_UPDATE
from chunkjax.stages import first_readers


def ref_grad_done(traces, tide):
    first = first_readers([t.chunks for t in traces])
    done = {}
    for i, m in enumerate(tide.moments):
        if m.phase != "forward":
            for c, s in first.items():
                if s == m.stage:
                    done[c] = i
    return done


def ref_program_ends(n_stages, n_moments, segments):
    bounds = list(segments) + [n_moments]
    bwd = n_moments - (n_stages - 1)
    return [(p0, p1, min(1.0, max(0.0, (p1 - (n_stages - 1)) / bwd))) for p0, p1 in zip(bounds[:-1], bounds[1:])]


def ref_host_ready(chunk_size, traces, n, loc, segments, gd):
    out = []
    for p0, p1, frac in ref_program_ends(len(traces), n, segments):
        params = sum(chunk_size for c, u in enumerate(loc) if u == HOST_UPDATE and p0 <= gd.get(c, n - 1) < p1)
        if params:
            out.append((frac, params))
    return out


def ref_streamed_ready(cb, traces, n, pk, loc, segments, gd):
    out, first = [], n
    for p0, p1, frac in ref_program_ends(len(traces), n, segments):
        for c, (k, u) in enumerate(zip(pk, loc)):
            if u == STREAMED_UPDATE and p0 <= gd.get(c, n - 1) < p1:
                out.append((frac, cb.grad + cb.state, cb.state + (cb.params if k == PINNED_HOST else 0)))
                first = min(first, p1)
    return out, first


def ref_window(done_moments, starts, grad_bytes, window):
    per = [0] * len(starts)
    for t in done_moments:
        per[max(i for i, s in enumerate(starts) if s <= t)] += grad_bytes
    w = max(1, min(window, len(per)))
    return int(max((sum(per[i:i + w]) for i in range(len(per) - w + 1)), default=0))


def ref_next_read(fetch, segments, prefetch, n_stages):
    bounds = list(segments) + [len(fetch)]
    first = {}
    for u, cs in enumerate(fetch):
        for c in cs:
            first.setdefault(c, u)
    n_fwd = max(1, n_stages - 1)
    return {c: min(1.0, next((a for a, b in zip(bounds[:-1], bounds[1:]) if u < b + prefetch), bounds[-2]) / n_fwd)
            for c, u in first.items()}


def test_indexing_helpers_equal_their_definitions():
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    cb = types.SimpleNamespace(grad=3, state=7, params=11)
    checked = 0
    while checked < 2000:
        ns, n_chunks = rng.randint(1, 8), rng.randint(1, 40)
        traces = [types.SimpleNamespace(chunks=rng.sample(range(n_chunks), rng.randint(0, min(n_chunks, 6))))
                  for _ in range(ns)]
        mb = rng.randint(1, 3)
        moments = ([(s, "forward") for s in range(ns)] + [(s, "backward") for _ in range(mb) for s in reversed(range(ns))]
                   if rng.random() < 0.7 else
                   [(rng.randrange(ns), rng.choice(["forward", "backward", "fused"])) for _ in range(rng.randint(1, 12))])
        tide = types.SimpleNamespace(moments=[types.SimpleNamespace(stage=s, phase=p) for s, p in moments])
        n = len(moments)
        if n - (ns - 1) <= 0:
            continue
        done = pr.grad_done_moments(traces, tide)
        want = ref_grad_done(traces, tide)
        assert done == want and list(done) == list(want), seed
        segs = sorted({0, *rng.sample(range(n), min(n, rng.randint(0, 5)))})
        loc = [rng.choice([HOST_UPDATE, STREAMED_UPDATE, DEVICE_UPDATE]) for _ in range(n_chunks)]
        pk = [rng.choice([PINNED_HOST, DEVICE]) for _ in range(n_chunks)]
        gd = done if rng.random() < 0.7 else {c: rng.randint(-1, n + 1) for c in range(n_chunks) if rng.random() < 0.8}
        assert pr._host_ready(5, traces, n, loc, segs, gd) == ref_host_ready(5, traces, n, loc, segs, gd), seed
        assert pr._streamed_ready(cb, traces, n, pk, loc, segs, gd) == ref_streamed_ready(cb, traces, n, pk, loc, segs, gd), seed
        dm = [rng.randint(0, n + 3) for _ in range(rng.randint(0, 20))]
        w = rng.randint(1, 4)
        assert pr.grad_window_bytes(dm, segs, 7, w) == ref_window(dm, segs, 7, w), seed
        fetch = [rng.sample(range(n_chunks), rng.randint(0, min(n_chunks, 4))) for _ in range(n)]
        k = rng.randint(0, 3)
        got, want = cross_step.next_read_fractions(fetch, segs, k, ns), ref_next_read(fetch, segs, k, ns)
        assert got == want and list(got) == list(want), seed
        checked += 1


def test_a_gradient_before_the_first_program_is_refused():
    try:
        pr.grad_window_bytes([0], [2, 5], 4)
    except ValueError as e:
        assert "before the first program" in str(e)
    else:
        raise AssertionError("no error")
