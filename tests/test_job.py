"""job.py's analysis stages on real files: the roofline with measured kernel efficiency, and config validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from servescope.errors import ConfigError
from servescope.job import JobConfig, write_roofline
from servescope.run import ROOFLINE, RunDir

H200_KERNELS = Path(__file__).parents[1] / "docs" / "measurements" / "kernels-h200-full-kernels.json"


def test_roofline_calibrated_with_h200_kernel_measurements(tmp_path):
    from servescope import hardware, models

    run = RunDir.create(tmp_path / "run", {"command": "test"}, {})
    cfg = JobConfig(concurrency=(64, 1024), tp=8, ep=8, dtype="bf16", calibrate=H200_KERNELS)
    model, gpu = models.get_model("glm-5"), hardware.get_gpu("NVIDIA H200")
    assert write_roofline(run, cfg, model, gpu, "bf16") is not None
    calibrated = run.read_json(ROOFLINE)
    assert calibrated["calibration"]["source"] == str(H200_KERNELS)
    ideal_run = RunDir.create(tmp_path / "ideal", {"command": "test"}, {})
    write_roofline(ideal_run, JobConfig(concurrency=(64, 1024), tp=8, ep=8, dtype="bf16"), model, gpu, "bf16")
    ideal = ideal_run.read_json(ROOFLINE)
    assert ideal["calibration"] is None
    for cp, ip in zip(calibrated["points"], ideal["points"], strict=True):
        experts = [g for g in cp["gemms"] if g["group"] == "experts"]
        assert experts and all(0 < g["efficiency"] <= 1 for g in experts)
        # Measured kernels are never faster than the ideal roofline: the bound can only drop.
        assert cp["tok_s_upper_bound"] <= ip["tok_s_upper_bound"] * (1 + 1e-9)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"concurrency": ()}, "--concurrency"),
        ({"concurrency": (4, -1)}, "--concurrency"),
        ({"input_len": 0}, "--input-len"),
        ({"num_prompts": 4, "duration_s": 3.0}, "not both"),
        ({"engine": "tgi"}, "--engine"),
        ({"device": "tpu"}, "--device"),
        ({"url": "http://127.0.0.1:1", "engine_args": ("--x",)}, "embedded engine only"),
    ],
)
def test_job_config_rejects_bad_values(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        JobConfig(**kwargs).validate()
