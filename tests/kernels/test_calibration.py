"""Calibration: best correct backend per point, interpolated in log(tokens), read from results files."""

from __future__ import annotations

import math

import pytest

from servescope.errors import ConfigError, RunDataError, UnknownNameError
from servescope.kernels.calibration import load_calibration
from servescope.kernels.results import write_results

from .factory import point, results


def _write(tmp_path, pts, **kw):
    return write_results(tmp_path, results(pts, **kw))


def test_efficiency_is_the_best_correct_backend_at_measured_points(tmp_path):
    pts = [point("torch-loop", 1, 40.0), point("triton", 1, 90.0), point("triton", 4, 30.0),
           point("torch-grouped-mm", 4, 60.0), point("triton", 16, None, status="wrong"),
           point("torch-loop", 16, 20.0)]
    cal = load_calibration(_write(tmp_path, pts))
    assert cal.basis == "measured"
    assert cal.efficiency("bf16", 1) == pytest.approx(0.90)
    assert cal.efficiency("bf16", 4) == pytest.approx(0.60)  # grouped_mm beats triton there
    assert cal.efficiency("bf16", 16) == pytest.approx(0.20)  # the wrong triton point is ignored
    assert cal.best_backend("bf16", 4) == "torch-grouped-mm"
    assert cal.efficiency("bf16", 1, backend="torch-loop") == pytest.approx(0.40)


def test_interpolation_is_linear_in_log_tokens_and_held_outside(tmp_path):
    cal = load_calibration(_write(tmp_path, [point("triton", 1, 80.0), point("triton", 16, 40.0)]))
    assert cal.efficiency("bf16", 4) == pytest.approx(0.80 + (math.log(4) / math.log(16)) * (0.40 - 0.80))
    assert cal.efficiency("bf16", 0.25) == pytest.approx(0.80)
    assert cal.efficiency("bf16", 4096) == pytest.approx(0.40)


def test_efficiency_is_capped_at_one_and_uses_datasheet_basis_when_present(tmp_path):
    pts = [point("triton", 1, 106.0, pct_peak=93.0), point("triton", 8, 101.0, pct_peak=88.0)]
    cal = load_calibration(_write(tmp_path, pts, datasheet=True))
    assert cal.basis == "datasheet"
    assert cal.efficiency("bf16", 1) == pytest.approx(0.93)
    cal_measured = load_calibration(_write(tmp_path / "m", [point("triton", 1, 106.0)]))
    assert cal_measured.efficiency("bf16", 1) == 1.0


def test_several_models_average_unless_one_is_named(tmp_path):
    pts = [point("triton", 1, 80.0, model="glm-5"), point("triton", 1, 60.0, model="qwen3-235b-a22b")]
    cal = load_calibration(_write(tmp_path, pts))
    assert cal.efficiency("bf16", 1) == pytest.approx(0.70)
    assert cal.efficiency("bf16", 1, model="qwen3-235b-a22b") == pytest.approx(0.60)
    with pytest.raises(UnknownNameError):
        cal.efficiency("bf16", 1, model="kimi-k2")


def test_unknown_dtype_bad_tokens_and_untimed_files_are_errors(tmp_path):
    cal = load_calibration(_write(tmp_path, [point("triton", 1, 80.0)]))
    with pytest.raises(UnknownNameError, match="fp8"):
        cal.efficiency("fp8", 1)
    with pytest.raises(ConfigError, match="> 0"):
        cal.efficiency("bf16", 0)
    with pytest.raises(RunDataError, match="no correct, timed"):
        load_calibration(_write(tmp_path / "bad", [point("triton", 1, None, status="wrong")]))
