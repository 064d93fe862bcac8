"""The step's timeline (issue 23): the gradient window and the program cut the planner chooses on
it (the engine running a chosen cut and window: tests/test_overlap.py, "the gradient window").

Timeline figures are hand-computed on synthetic numbers (rates of 1 FLOP/s, 1 s per host
parameter). The 3B-shaped plan is synthetic stage traces of the issue-22 model (30 stages, 60
chunks of 53M elements, bf16) at the H200's measured rates."""
from __future__ import annotations

import types

import pytest

import chunkjax as cj
from chunkjax.cost import Rates, predict_pipelined_step, program_timeline
from chunkjax.plan import plan_schedule
from chunkjax.predict import ChunkBytes
from chunkjax.program_cut import MAX_WINDOW, TURN_LEVELS, auto_segments, retime, turn_cut, uniform_segments
from chunkjax.tide import memory_tide
from chunkjax.trace import StageTrace


def test_window_stalls_the_device_until_the_host_catches_up():
    """Programs of 2, 1, 1 s on the device (the forward 1 s + a third of a 3 s backward, then
    two thirds); the host gets 3 s of work from the first and 1 s from the second. Window 2: after
    handing over the second program's gradients the main thread waits for the host to finish the
    first's (at 5 s), so the third program runs 5-6 (the device idle 2 s) and the host ends at 6
    with nothing exposed. Window 3: no wait; the backward ends at 4, the host at 6 (2 s exposed).
    Both steps take 6 s; the window bounds the host gradients that exist at once."""
    times = program_timeline([2.0, 3.0, 4.0], [3.0, 1.0, 0.0], window=2)
    assert [(t.dispatch_s, t.start_s, t.end_s, t.host_end_s) for t in times] == [
        (0.0, 0.0, 2.0, 5.0), (0.0, 2.0, 3.0, 6.0), (5.0, 5.0, 6.0, 6.0)]
    assert program_timeline([2.0, 3.0, 4.0], [3.0, 1.0, 0.0], window=3)[-1].end_s == 4.0
    # one program kept queued (early streamed chunks): the third waits for the first to end
    held = program_timeline([2.0, 3.0, 4.0], [0.0, 0.0, 0.0], window=0, hold_one=[False, True, False])
    assert [t.dispatch_s for t in held] == [0.0, 0.0, 2.0]
    r = Rates(matmul_flops_per_s=1.0, host_update_s_per_param=1.0, h2d_bytes_per_s=1.0, d2h_bytes_per_s=1.0,
              one_program_duplex_bytes_per_s=1.0, duplex_bytes_per_s=2.0, device_update_s_per_param=0.0)
    kw = dict(fwd_h2d=0, bwd_h2d=0, bwd_d2h=0, device_params=0, host_ready=[(1 / 3, 3), (2 / 3, 1)],
              program_ends=(1 / 3, 2 / 3, 1.0), rates=r)
    w2 = predict_pipelined_step(3.0, window=2, **kw)
    assert (w2.forward_s, w2.backward_s, w2.window_stall_s, w2.host_update_s) == (1.0, 3.0, 2.0, 4.0)
    assert w2.host_update_exposed_s == 0.0 and w2.step_s == 6.0 and w2.to_dict()["window"] == 2
    w3 = predict_pipelined_step(3.0, window=3, **kw)
    assert (w3.window_stall_s, w3.host_update_exposed_s, w3.step_s) == (0.0, 2.0, 6.0)
    # programs of 1.5, 0.5 and 2 s, host work 3, 1 and 1 s: window 2 holds the 2 s program until
    # the host is done with the first hand-off (4.5); it runs 4.5-6.5 and the host's last second
    # follows it (7.5). Window 3 runs it 2-4 under the host, which ends at 6.5
    kw3 = dict(kw, host_ready=[(1 / 6, 3), (1 / 3, 1), (1.0, 1)], program_ends=(1 / 6, 1 / 3, 1.0))
    a, b = predict_pipelined_step(3.0, window=2, **kw3), predict_pipelined_step(3.0, window=3, **kw3)
    assert (a.window_stall_s, a.host_update_exposed_s, a.step_s) == pytest.approx((2.5, 1.0, 7.5))
    assert (b.window_stall_s, b.host_update_exposed_s, b.step_s) == pytest.approx((0.0, 2.5, 6.5))
    with pytest.raises(ValueError, match="one entry per program"):
        program_timeline([1.0], [], window=2)


# ---- the 3B-shaped plan ---------------------------------------------------------------------------

CS = 52953088  # elements per chunk of the issue-22 plan
H200 = Rates(matmul_flops_per_s=475e12, h2d_bytes_per_s=54e9, d2h_bytes_per_s=54e9, duplex_bytes_per_s=94e9,
             host_update_s_per_param=2.816e-10)


@pytest.fixture(scope="module")
def plan_3b():
    """Stage traces shaped as the 3B model's at batch 16 x 1024 (embedding, 28 blocks of two
    chunks, the head), bf16 chunk bytes with AdamW state, and its planned schedule."""
    act = 16 * 1024 * 3072 * 2
    traces = ([StageTrace("pre", (0,), 0, 2 * act, bwd_chunks=())]
              + [StageTrace(f"block{i}", (2 * i + 1, 2 * i + 2), act, 24 * act) for i in range(28)]
              + [StageTrace("post", (57, 58, 59), act, 40 * act)])
    layout = types.SimpleNamespace(n_chunks=60, chunk_size=CS)
    cb = ChunkBytes(params=2 * CS, grad=2 * CS, master=4 * CS, opt=8 * CS)
    kw = dict(flops_per_step=304.3e12, rates=H200, host_budget_bytes=110 * 2**30)
    s = plan_schedule(layout, traces, cb, 15 * 2**30, **kw)
    return layout, traces, cb, kw, s


def test_planner_chooses_a_finer_cut_when_the_host_is_the_bottleneck(plan_3b):
    """The host AdamW of the host chunks outlasts the backward: the planner's cut is not the
    doubling one, its predicted step is faster than the doubling cut's (same placement, any
    window 2-4), and the chosen cut and window are in the schedule (and its dict)."""
    layout, traces, cb, kw, s = plan_3b
    tide = memory_tide(traces, CS)
    T = len(tide.moments)
    doubling = auto_segments(T, len(traces))
    assert s.predicted.time.host_update_s > s.predicted.time.backward_s  # the host is the bottleneck
    assert tuple(s.segments) != doubling and 2 <= s.grad_window <= MAX_WINDOW
    opts = dict(chunk_size=CS, traces=traces, tide=tide, rates=H200, flops_per_step=kw["flops_per_step"])
    for w in range(2, MAX_WINDOW + 1):
        assert s.predicted.time.step_s < retime(s, cb, segments=doubling, window=w, **opts).time.step_s
    again = retime(s, cb, **opts)
    assert again.time.step_s == pytest.approx(s.predicted.time.step_s, rel=1e-12)
    assert s.predicted.host_bytes <= kw["host_budget_bytes"] and s.predicted.peak_device_bytes <= 15 * 2**30
    d = s.to_dict()
    assert d["grad_window"] == s.grad_window and d["predicted"]["time"]["window"] == s.grad_window
    assert cj.Schedule.from_dict(d) == s
    assert uniform_segments(T, len(traces), 10) == (0, 30, 40, 50)


# ---- the turn cut (cross-step overlap) ------------------------------------------------------------

def test_turn_cut_cuts_the_forward_end_and_the_backward_start_finer():
    """Forward levels add starts 1, 2, 4 ... moments before the fused head's program ends (the
    head stays with the forward's last moment); backward levels add starts 1, 2, 4 ... moments
    after the backward's first; starts already there, or past either end, add nothing."""
    base = (0, 5, 10, 13)  # 10 stages: forward moments 0-8, the head 9, the backward 10-18
    assert turn_cut(base, 19, 10, 0, 0) == base
    assert turn_cut(base, 19, 10, 3, 0) == (0, 2, 5, 6, 8, 10, 13)
    assert turn_cut(base, 19, 10, 0, 3) == (0, 5, 10, 11, 13, 17)
    assert turn_cut(base, 19, 10, 2, 1) == (0, 5, 6, 8, 10, 11, 13)
    assert turn_cut(base, 19, 10, 9, 9) == (0, 2, 5, 6, 8, 10, 11, 13, 17)  # stops at both ends
    assert turn_cut((0, 10), 12, 10, 0, 5) == (0, 10, 11)


def _gpt3_6b_shaped():
    """Stage traces shaped as GPT3_6B's at batch 16 x 1024 (the bench's layout: an embedding of 5
    chunks, 53 blocks of 4 chunks of 39,321,600 elements sharing their boundary chunks, a tied
    head), with the per-stage temporaries recorded on the H200 (``bench_s23c_6b16.json``)."""
    act = 100663296
    traces = ([StageTrace("embed", (0, 1, 2, 3, 4), 0, 416022528, bwd_chunks=(), output_bytes=act)]
              + [StageTrace(f"h_{i}", tuple(range(4 + 3 * i, 8 + 3 * i)), act, 2643936544, output_bytes=act)
                 for i in range(53)]
              + [StageTrace("head", (0, 1, 2, 3, 163), act, 1175004732, output_bytes=4)])
    cs = 39321600
    layout = types.SimpleNamespace(n_chunks=164, chunk_size=cs)
    return layout, traces, ChunkBytes(params=2 * cs, grad=2 * cs, master=4 * cs, opt=8 * cs + 12)


def test_planner_cuts_the_turn_finer_when_the_host_is_the_bottleneck():
    """GPT3_6B-shaped, 24 chunks resident, the rest host-updated at the host kernel's in-step
    rate of s23c (0.266 ns/param), cross-step overlap: the host thread idles from its last update
    (read by the next forward's last program) to the next backward's first host gradients. The
    planner's cut with the turn cuts has a one-moment program at the backward's start and a
    shorter program ending the forward, and is predicted faster than the best cut without them,
    which it would retime to exactly (same placement); the cut is kept in the schedule's dict."""
    layout, traces, cb = _gpt3_6b_shaped()
    r = Rates(matmul_flops_per_s=616e12, host_update_s_per_param=2.66e-10)
    kw = dict(flops_per_step=6 * 6.16e9 * 16 * 1024, rates=r, cross_step=True, resident=list(range(24)),
              host_budget_bytes=121420359884)
    turned = plan_schedule(layout, traces, cb, 23114180198, **kw)
    before = plan_schedule(layout, traces, cb, 23114180198, turn_cut=False, **kw)
    n, T = len(traces), len(turned.moments)
    assert turned.update_locations == before.update_locations
    assert {n, n + 1} <= set(turned.segments) and n + 1 not in before.segments
    last_fwd = lambda s: n - max(x for x in s.segments if x < n)  # the forward's last program's moments
    assert last_fwd(turned) < last_fwd(before)
    assert turned.predicted.time.step_s < 0.98 * before.predicted.time.step_s
    assert turned.predicted.time.host_update_s == pytest.approx(before.predicted.time.host_update_s)
    opts = dict(chunk_size=layout.chunk_size, traces=traces, tide=memory_tide(traces, layout.chunk_size), rates=r,
                flops_per_step=kw["flops_per_step"], cross_step=True)
    assert retime(turned, cb, segments=before.segments, window=before.grad_window,
                  streamed_early=before.streamed_early, **opts).time.step_s == pytest.approx(
        before.predicted.time.step_s, rel=1e-12)
    assert turned.segments == turn_cut(before.segments, T, n, *_levels(turned.segments, before.segments, T, n))
    assert cj.Schedule.from_dict(turned.to_dict()) == turned


def _levels(turned, before, T, n):
    """The :data:`TURN_LEVELS` entry that makes ``turned`` from ``before`` (AssertionError: none)."""
    for lv in TURN_LEVELS:
        if turn_cut(before, T, n, *lv) == tuple(turned):
            return lv
    raise AssertionError(f"{turned} is no turn cut of {before}")
