"""Calibration fits: known coefficients are recovered from synthetic traces."""
import pytest

from megaloom.runtime import ConfigError, Trace, TraceEvent
from megaloom.scheduler import CostModel, load_profile
from megaloom.runtime.registry import Cost
from megaloom.scheduler.fit import UNBOUNDED, dispatch_latency, fit_table, fit_traces


def _trace(rows, gap=0.0):
    """Events one after another on one unit, each starting ``gap`` after the previous ends."""
    events, t = [], 0.0
    for i, (op, engine, flops, nbytes, dur) in enumerate(rows):
        t += gap
        events.append(TraceEvent(i, f"{op}{i}", op, engine, 0, 0, t, t + dur, flops, nbytes, 0.0, [i - 1] if i else []))
        t += dur
    return Trace(events, {"units": {"cube": 1, "vector": 1}})


def test_compute_and_memory_bound_ops_are_recovered():
    rows = [("mm", "cube", f, f / 100, 4e-6 + f / 5e10) for f in (1e6, 3e6, 1e7, 4e7)]
    rows += [("add", "vector", 0.0, b, 2e-6 + b / 8e9) for b in (1e4, 5e4, 2e5, 1e6)]
    fits = fit_traces([_trace(rows)], dispatch=False)
    mm, add = fits["mm"].coeffs, fits["add"].coeffs
    assert mm.throughput == pytest.approx(5e10, rel=1e-6) and mm.overhead == pytest.approx(4e-6, rel=1e-6)
    assert mm.mem_bw == UNBOUNDED and add.throughput == UNBOUNDED
    assert add.mem_bw == pytest.approx(8e9, rel=1e-6) and add.overhead == pytest.approx(2e-6, rel=1e-6)
    assert fits["mm"].median_rel_error < 1e-9 and fits["mm"].samples == 4
    assert "mm" in fit_table(fits) and "add" in fit_table(fits)


def test_fitted_coefficients_drive_the_cost_model():
    rows = [("mm", "cube", f, 0.0, 1e-5 + f / 2e10) for f in (1e6, 2e6, 8e6)]
    fits = fit_traces([_trace(rows)], dispatch=False)
    model = CostModel(load_profile("cpu"), overrides={op: f.coeffs for op, f in fits.items()})
    assert model.duration(Cost(flops=4e6), "cube", op="mm") == pytest.approx(1e-5 + 4e6 / 2e10, rel=1e-6)


def test_dispatch_latency_is_measured_and_added_to_overheads():
    rows = [("mm", "cube", f, 0.0, 1e-5 + f / 2e10) for f in (1e6, 2e6, 8e6)]
    trace = _trace(rows, gap=3e-6)
    assert dispatch_latency([trace]) == pytest.approx(3e-6)
    fit = fit_traces([trace])["mm"]
    assert fit.coeffs.overhead == pytest.approx(1.3e-5, rel=1e-6)


def test_noisy_samples_keep_a_positive_rate_and_report_residuals():
    rows = [("mm", "cube", f, 0.0, (1e-6 + f / 1e10) * (1.1 if i % 2 else 0.9)) for i, f in enumerate((1e6, 2e6, 4e6, 8e6))]
    fit = fit_traces([_trace(rows)], dispatch=False)["mm"]
    assert fit.coeffs.throughput > 0 and fit.coeffs.overhead >= 0
    assert 0.0 < fit.median_rel_error < 0.2


def test_ops_without_work_get_their_mean_duration():
    fit = fit_traces([_trace([("barrier", "comm", 0.0, 0.0, d) for d in (1e-6, 3e-6)])], dispatch=False)["barrier"]
    assert fit.coeffs.overhead == pytest.approx(2e-6)


def test_no_timed_events_is_a_config_error():
    with pytest.raises(ConfigError, match="timed events"):
        fit_traces([Trace([], {})])
