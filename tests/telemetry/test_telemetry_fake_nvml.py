"""The recorder/fake pair itself: replay order, strictness, serialisation, record-replay round trip."""

from __future__ import annotations

import ctypes

import pytest

from servescope.telemetry.fake_nvml import (
    FakeNvml,
    FakeNVMLError,
    FakeNvmlMissingResponse,
    RecordingNvml,
    load_recording,
    to_jsonable,
)
from servescope.telemetry.nvml import Nvml, describe_gpus


def test_the_fixture_is_a_real_h200_recording(recording):
    meta = recording["meta"]
    assert meta["dry_run_from"] is None  # recorded on the GPU, not replayed
    assert meta["gpus"][0]["name"] == "NVIDIA H200"
    assert [p["label"] for p in meta["phases"]] == ["idle", "memcpy", "matmul", "cooldown"]
    assert len(recording["calls"]) > 1000
    assert all(c["dur_ns"] > 0 for c in recording["calls"])


def test_answers_come_in_recorded_order_per_call_and_then_hold(recording):
    fake = FakeNvml(recording)
    recorded = [e["result"] for e in fake.responses("nvmlDeviceGetPowerUsage")]
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    got = [fake.nvmlDeviceGetPowerUsage(handle) for _ in range(len(recorded) + 3)]
    assert got[: len(recorded)] == recorded
    assert got[len(recorded):] == [recorded[-1]] * 3


def test_a_call_the_recording_never_saw_fails_loudly(fake):
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(FakeNvmlMissingResponse, match="nvmlDeviceGetClockInfo"):
        fake.nvmlDeviceGetClockInfo(handle, 99)
    with pytest.raises(AttributeError):
        fake.nvmlDeviceGetSomethingNobodyRecorded  # noqa: B018 - attribute access is the test


def test_injected_faults_raise_nvml_errors_for_one_gpu_and_function(fake):
    fake.fail(gpu=0, fn="nvmlDeviceGetTemperature", error=15, after_calls=1, times=1)
    h = fake.nvmlDeviceGetHandleByIndex(0)
    fake.nvmlDeviceGetTemperature(h, 0)
    with pytest.raises(FakeNVMLError) as err:
        fake.nvmlDeviceGetTemperature(h, 0)
    assert err.value.value == 15
    fake.nvmlDeviceGetTemperature(h, 0)  # times=1: recovered


def test_to_jsonable_walks_ctypes_structs_unions_and_arrays():
    class U(ctypes.Union):
        _fields_ = [("dVal", ctypes.c_double), ("uiVal", ctypes.c_uint)]

    class S(ctypes.Structure):
        _fields_ = [("fieldId", ctypes.c_uint), ("value", U), ("name", ctypes.c_char * 8)]

    arr = (S * 2)()
    arr[0].fieldId = 186
    arr[0].value.uiVal = 123456
    arr[0].name = b"H200"
    out = to_jsonable(arr)
    assert out[0]["fieldId"] == 186 and out[0]["value"]["uiVal"] == 123456 and out[0]["name"] == "H200"
    assert to_jsonable(ctypes.pointer(ctypes.c_int(3))) is None  # opaque handles carry no data


def test_record_then_replay_round_trip(fake, tmp_path):
    # Record the fake as if it were pynvml, then replay the new recording: same answers.
    recorder = RecordingNvml(fake)
    first = describe_gpus(recorder)
    with Nvml(recorder) as nvml:
        gpu = nvml.open_gpus([0], gpm_period_s=0.0, energy_period_s=0.0)[0]
        rows = []
        for _ in range(4):
            row: dict = {}
            gpu.read(row)
            rows.append(row)
        gpu.close()
    path = recorder.dump(tmp_path / "again.json.gz", meta={"source": "round trip"})
    again = load_recording(path)
    assert again["meta"] == {"source": "round trip"}
    assert again["constants"]["NVML_ERROR_NOT_SUPPORTED"] == 3
    replay = FakeNvml(again)
    assert describe_gpus(replay) == first
    with Nvml(replay) as nvml:
        gpu = nvml.open_gpus([0], gpm_period_s=0.0, energy_period_s=0.0)[0]
        for expected in rows:
            row = {}
            gpu.read(row)
            assert row == expected
