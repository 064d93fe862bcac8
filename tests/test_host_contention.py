"""The host kernel's rate beside a step's transfers and compute (chunkjax.host_contention): the cost model
times the step's host thread at the loaded rate where it was measured, the recorded in-step rate replaces
it, and the start-up measurement runs its load and reports it."""
import dataclasses

import numpy as np

import pytest

from chunkjax import dropin
from chunkjax.cost import Rates, predict_pipelined_step
from chunkjax.host_contention import measure_loaded_host_update_rate, step_host_s_per_param


def test_step_host_rate_is_the_loaded_one_where_measured():
    r = Rates()
    assert r.host_update_loaded_s_per_param == 0.0 and step_host_s_per_param(r) == r.host_update_s_per_param
    loaded = dataclasses.replace(r, host_update_loaded_s_per_param=0.41e-9)
    assert step_host_s_per_param(loaded) == 0.41e-9


def _unit_rates(**kw) -> Rates:
    return Rates(matmul_flops_per_s=1.0, host_update_s_per_param=1.0, h2d_bytes_per_s=1.0, d2h_bytes_per_s=1.0,
                 one_program_duplex_bytes_per_s=1.0, duplex_bytes_per_s=2.0, device_update_s_per_param=0.0, **kw)


@pytest.mark.parametrize("cross_step", [False, True])
def test_pipelined_step_times_the_host_thread_at_the_loaded_rate(cross_step):
    """A 3 s step (forward 1 s, backward 2 s in three programs) whose host thread gets 3 + 1 params: with
    the kernel alone at 1 s/param and beside the step at 1.5 the prediction is the one at 1.5 alone
    (host 6 s, 1.5 s of it after the backward at window 2), not the one at 1 (host 4 s)."""
    kw = dict(fwd_h2d=0, bwd_h2d=0, bwd_d2h=0, device_params=0, host_ready=[(1 / 3, 3), (2 / 3, 1)],
              program_ends=(1 / 3, 2 / 3, 1.0), window=2, cross_step=cross_step,
              host_reads=[(0.5, 3), (0.9, 1)] if cross_step else ())
    alone = predict_pipelined_step(3.0, rates=_unit_rates(), **kw)
    loaded = predict_pipelined_step(3.0, rates=_unit_rates(host_update_loaded_s_per_param=1.5), **kw)
    at = predict_pipelined_step(3.0, rates=dataclasses.replace(_unit_rates(), host_update_s_per_param=1.5), **kw)
    assert loaded == at
    assert (alone.host_update_s, loaded.host_update_s) == pytest.approx((4.0, 6.0))
    assert loaded.step_s > alone.step_s


def test_dropin_update_times_its_kernel_at_the_loaded_rate():
    """The drop-in's offloaded update (dropin.predict_update_parts): its kernel term at the loaded rate."""
    args = (0, 4, 1000, 4000, 2000, 2000)
    r = _unit_rates()
    assert dropin.predict_update_parts(*args, r).kernel_s == pytest.approx(4000.0)
    assert dropin.predict_update_parts(*args, dataclasses.replace(r, host_update_loaded_s_per_param=2.0)).kernel_s \
        == pytest.approx(8000.0)


def _bench_record(update_s):
    rates = dataclasses.asdict(dataclasses.replace(Rates(), host_update_s_per_param=0.2e-9,
                                                   host_update_loaded_s_per_param=0.3e-9))
    extra = {"rates": rates, "schedule_counts": {"params_pinned_host/update_host": 10,
                                                 "params_device/update_device": 2}, "chunk_size": 1000}
    return {"systems": {"chunkjax": {"extra": extra, "update_s": update_s}}}


def test_recorded_in_step_rate_replaces_the_loaded_calibration():
    """A bench record with both start-up rates: Rates.from_record times the step at its host thread's
    measured rate (update_s over the host-updated params) and drops the loaded calibration; without a
    measured update it keeps both as calibrated."""
    r = Rates.from_record(_bench_record(update_s=4e-6))
    assert r.host_update_s_per_param == pytest.approx(4e-6 / (10 * 1000))
    assert r.host_update_loaded_s_per_param == 0.0 and step_host_s_per_param(r) == r.host_update_s_per_param
    kept = Rates.from_record(_bench_record(update_s=None))
    assert (kept.host_update_s_per_param, kept.host_update_loaded_s_per_param) == (0.2e-9, 0.3e-9)


def test_loaded_calibration_runs_its_load_and_reports_it():
    """measure_loaded_host_update_rate (tiny, on the CPU backend: the numbers mean nothing here) returns the
    median call, reports the fastest, both directions' bytes per second while it ran, and stops its
    threads; bad sizes are refused."""
    import threading
    before = threading.active_count()
    stats = {}
    med = measure_loaded_host_update_rate(2**12, 3, load_bytes=2**12, matmul=16, settle_s=0.01, stats=stats)
    assert 0 < stats["loaded_min_s_per_param"] <= med == stats["loaded_median_s_per_param"]
    assert (stats["loaded_n"], stats["loaded_repeats"]) == (2**12, 3)
    assert stats["loaded_h2d_bytes_per_s"] > 0 and stats["loaded_d2h_bytes_per_s"] > 0
    assert threading.active_count() == before
    with pytest.raises(ValueError, match="repeats >= 1"):
        measure_loaded_host_update_rate(2**12, 0)


def test_prediction_check_reads_the_recorded_runs():
    """experiments/prediction_check.py part 1 on the committed records: the s17m single micro-batch run's
    measured and predicted step, its host kernel's rate in the step against its calibration, and its
    profiled step's forward and backward programs (16 programs, 5 of them forward)."""
    from experiments.prediction_check import recorded_rows, table
    rows = {r["run"]: r for r in recorded_rows()}
    r = rows["bench_s17m_6b16_one"]
    assert (r["step_s"], r["predicted_s"]) == pytest.approx((1.6864, 1.4069), abs=1e-4)
    assert r["in_step_ns"] == pytest.approx(1.4897 / (140 * 39321600) * 1e9, rel=1e-4) and r["cross_step"]
    assert r["calibrated_ns"] == pytest.approx(0.2217, abs=1e-4)
    assert (r["profile"]["forward_s"], r["profile"]["backward_s"]) == pytest.approx((0.381, 1.049), abs=2e-3)
    assert rows["bench_s17m_6b16_clip"]["clip_fired"] and not rows["bench_s14a_6b16_clip"]["clip_fired"]
    assert rows["bench_s17b_18b_disk"]["storage_update_s_predicted"] == pytest.approx(90.78, abs=0.01)
    assert "| bench_s17m_6b16_one | GPT3_6B b16 (1) | cross-step | 1.686 | 1.407 | 1.199 |" in table(rows.values())


def test_calibrated_rates_plan_the_step_host_thread_from_both_timings(monkeypatch):
    """On a GPU the planner's rates time the step's host thread at the geometric mean of the alone
    timing's fastest call times :data:`~chunkjax.host_contention.IN_STEP_OVER_ALONE` and the loaded
    timing's fastest call, the alone rate kept beside it, all recorded in the stats; on the CPU the
    default rates (nothing measured)."""
    import jax

    from experiments import gpu_measure
    from chunkjax import host_contention, host_update
    assert gpu_measure.calibrated_rates() == (Rates(), None)
    rng = np.random.default_rng()
    alone, lo, med = sorted(rng.uniform(0.15e-9, 0.45e-9, 3))

    def alone_rate(n, stats=None):
        stats.update(min_s_per_param=alone, median_s_per_param=alone * 1.01)
        return alone

    def loaded_rate(n, stats=None):
        stats.update(loaded_min_s_per_param=lo, loaded_median_s_per_param=med)
        return med
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(gpu_measure, "matmul_tflops", lambda: 600.0)
    monkeypatch.setattr(host_update, "measure_host_update_rate", alone_rate)
    monkeypatch.setattr(host_contention, "measure_loaded_host_update_rate", loaded_rate)
    stats = {}
    r, tflops = gpu_measure.calibrated_rates(stats)
    planned = (alone * host_contention.IN_STEP_OVER_ALONE * lo) ** 0.5
    assert tflops == 600.0 and r.matmul_flops_per_s == pytest.approx(600e12 * 0.9)
    assert r.host_update_s_per_param == alone and r.host_update_loaded_s_per_param == pytest.approx(planned, rel=1e-15)
    assert step_host_s_per_param(r) == r.host_update_loaded_s_per_param
    assert stats["loaded_min_s_per_param"] == lo and stats["loaded_median_s_per_param"] == med
    assert stats["planned_step_s_per_param"] == r.host_update_loaded_s_per_param
    r2, _ = gpu_measure.calibrated_rates()  # without a stats dict
    assert r2 == r


@pytest.mark.parametrize("bad", [(0.0, 0.0), (-1e-10, 0.3e-9), (float("nan"), 0.0), (float("inf"), 0.0),
                                 (0.2e-9, float("inf")), (0.2e-9, float("nan"))])
def test_planned_step_rate_refuses_a_rate_that_is_not_positive(bad):
    from chunkjax.host_contention import planned_step_rate
    with pytest.raises(ValueError, match="positive finite"):
        planned_step_rate(*bad)


def test_planned_step_rate_is_the_geometric_mean_of_both_timings():
    """Alone times the in-step factor, combined with the loaded timing by a geometric mean (it lies
    between the two); the alone one times the factor where no loaded timing is given."""
    from chunkjax.host_contention import IN_STEP_OVER_ALONE, planned_step_rate
    rng = np.random.default_rng()
    a, lo = rng.uniform(0.15e-9, 0.4e-9, 2)
    p = planned_step_rate(a, lo)
    assert p == pytest.approx(float(np.sqrt(np.float64(a) * IN_STEP_OVER_ALONE * np.float64(lo))), rel=1e-14)
    assert min(a * IN_STEP_OVER_ALONE, lo) <= p <= max(a * IN_STEP_OVER_ALONE, lo)
    assert planned_step_rate(a) == planned_step_rate(a, 0.0) == pytest.approx(a * IN_STEP_OVER_ALONE, rel=1e-15)
