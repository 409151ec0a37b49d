"""A FAKE NVML that replays responses recorded from a real GPU, and the recorder that records them.

No CPU machine (CI, laptops) has NVML, yet the NVML wrapper (``nvml.py``), the sampler
and the windows must be exercised there. So instead of hand-written return values:

1. ``RecordingNvml(pynvml)`` wraps the real library on a GPU machine. Every ``nvml*``
   call made through it (function name, arguments, result or NVML error code, and how
   long the call took) is appended to a list; ``dump`` writes it as JSON (gzip if the
   name ends in ``.gz``). Handles become ``{"gpu": i}`` and GPM samples ``"<gpm_sample>"``
   so the keys do not depend on pointer values.
2. ``FakeNvml(recording)`` offers the same attributes ``nvml.py`` uses and answers each
   call with the next recorded response for the same (function, arguments) key, holding
   the last one once a key's responses are used up. Constants (``NVML_*``) come from
   the recording too. A call the recording never saw raises ``FakeNvmlMissingResponse``
   (an ``AssertionError``): a changed wrapper needs a new recording, not a silent default.

Fault injection (``fail``) and ``FakeNvml.unavailable`` cover what a recording of a
healthy GPU cannot hold: a GPU that dies mid-run, and a machine without NVML.

This module never imports pynvml: the recorder wraps whatever library object it is given.
"""

from __future__ import annotations

import ctypes
import gzip
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

RECORDING_SCHEMA = 1
_HANDLE = "<handle>"
_SAMPLE = "<gpm_sample>"

#: NVML return codes (nvml.h ``nvmlReturn_t``; the same numbers pynvml exports). A recording
#: of a healthy GPU may never touch an error constant, yet the wrapper needs them to
#: classify injected faults, so the fake knows them even when the recording does not.
NVML_ERROR_CODES = {
    "NVML_ERROR_UNINITIALIZED": 1,
    "NVML_ERROR_INVALID_ARGUMENT": 2,
    "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_NO_PERMISSION": 4,
    "NVML_ERROR_NOT_FOUND": 6,
    "NVML_ERROR_DRIVER_NOT_LOADED": 9,
    "NVML_ERROR_TIMEOUT": 10,
    "NVML_ERROR_LIBRARY_NOT_FOUND": 12,
    "NVML_ERROR_FUNCTION_NOT_FOUND": 13,
    "NVML_ERROR_GPU_IS_LOST": 15,
    "NVML_ERROR_IN_USE": 19,
    "NVML_ERROR_UNKNOWN": 999,
}


# ---------------------------------------------------------------------------------------
# JSON conversion shared by the recorder and the fake
# ---------------------------------------------------------------------------------------
def to_jsonable(value: Any) -> Any:
    """A JSON-friendly copy of an NVML result (ctypes structs/unions/arrays become dicts/lists)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, ctypes.Array):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (ctypes.Structure, ctypes.Union)):
        return {name: to_jsonable(getattr(value, name)) for name, *_ in value._fields_}
    if isinstance(value, ctypes._Pointer):  # opaque handles: identity is not data
        return None
    if isinstance(value, SimpleNamespace):
        return {k: to_jsonable(v) for k, v in vars(value).items()}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    return repr(value)


def _to_obj(value: Any) -> Any:
    if isinstance(value, dict):
        return SimpleNamespace(**{k: _to_obj(v) for k, v in value.items()})
    if isinstance(value, list):
        return [_to_obj(v) for v in value]
    return value


def _key(fn: str, args: list[Any]) -> str:
    return fn + json.dumps(args, sort_keys=True, separators=(",", ":"))


def load_recording(path: str | Path) -> dict[str, Any]:
    """Read a recording written by ``RecordingNvml.dump`` (``.json`` or ``.json.gz``)."""
    p = Path(path)
    raw = gzip.decompress(p.read_bytes()) if p.name.endswith(".gz") else p.read_bytes()
    data = json.loads(raw)
    if data.get("recording_schema") != RECORDING_SCHEMA:
        raise ValueError(f"{p}: not an NVML recording of schema {RECORDING_SCHEMA}")
    return data


# ---------------------------------------------------------------------------------------
# The recorder (runs on a GPU machine, wrapping the real pynvml)
# ---------------------------------------------------------------------------------------
class RecordingNvml:
    """Wraps a pynvml-like library and records every NVML call made through it."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self._lock = threading.Lock()
        self.calls: list[dict[str, Any]] = []
        self.constants: dict[str, int] = {}
        self._handle_gpu: dict[tuple[str, int], int] = {}
        self._sample_gpu: dict[tuple[str, int], int | None] = {}
        self._keep: list[Any] = []  # keep wrapped objects alive so their identity stays unique

    @property
    def NVMLError(self) -> Any:
        return self._lib.NVMLError

    def _arg(self, arg: Any) -> Any:
        ident = _ident(arg)
        if ident in self._handle_gpu:
            return {"gpu": self._handle_gpu[ident]}
        if ident in self._sample_gpu:
            return _SAMPLE
        if hasattr(arg, "numMetrics") and hasattr(arg, "sample2"):
            # ctypes copies the pointer into the struct: the address identifies the sample.
            gpu = self._sample_gpu.get(_ident(arg.sample2))
            return {"gpu": gpu, "metrics": [int(arg.metrics[i].metricId) for i in range(arg.numMetrics)]}
        return to_jsonable(arg)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._lib, name)
        if name.startswith("NVML_") and isinstance(value, int):
            self.constants[name] = value
            return value
        if name.startswith("nvml") and callable(value):
            return self._wrap(name, value)
        return value

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            key_args = [self._arg(a) for a in args]
            t0 = time.perf_counter_ns()
            try:
                result = fn(*args)
            except self._lib.NVMLError as err:
                entry = {"fn": name, "args": key_args, "error": int(err.value), "error_text": str(err),
                         "dur_ns": time.perf_counter_ns() - t0}
                with self._lock:
                    self.calls.append(entry)
                raise
            dur = time.perf_counter_ns() - t0
            with self._lock:
                if name == "nvmlDeviceGetHandleByIndex":
                    self._handle_gpu[_ident(result)] = int(args[0])
                    self._keep.append(result)
                    out: Any = _HANDLE
                elif name == "nvmlGpmSampleAlloc":
                    self._sample_gpu[_ident(result)] = None
                    self._keep.append(result)
                    out = _SAMPLE
                elif name == "nvmlGpmSampleGet":
                    self._sample_gpu[_ident(args[1])] = self._handle_gpu.get(_ident(args[0]))
                    out = _SAMPLE
                elif name == "nvmlGpmMetricsGet":
                    out = {"metrics": [
                        {"metricId": int(result.metrics[i].metricId), "nvmlReturn": int(result.metrics[i].nvmlReturn),
                         "value": float(result.metrics[i].value)}
                        for i in range(result.numMetrics)
                    ]}
                else:
                    out = to_jsonable(result)
                self.calls.append({"fn": name, "args": key_args, "result": out, "dur_ns": dur})
            return result

        return call

    def recording(self, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        for name in dir(self._lib):  # the error vocabulary, even if no call failed
            value = getattr(self._lib, name, None)
            if name.startswith("NVML_ERROR_") and isinstance(value, int):
                self.constants.setdefault(name, value)
        with self._lock:
            return {
                "recording_schema": RECORDING_SCHEMA,
                "meta": dict(meta or {}),
                "constants": dict(sorted(self.constants.items())),
                "calls": list(self.calls),
            }

    def dump(self, path: str | Path, meta: dict[str, Any] | None = None) -> Path:
        p = Path(path)
        data = json.dumps(self.recording(meta), separators=(",", ":")).encode()
        p.write_bytes(gzip.compress(data, mtime=0) if p.name.endswith(".gz") else data)
        return p


def _ident(obj: Any) -> tuple[str, int]:
    """A stable identity: the address for ctypes pointers (copied by value), else id()."""
    if isinstance(obj, ctypes._Pointer):
        return ("ptr", ctypes.cast(obj, ctypes.c_void_p).value or 0)
    return ("id", id(obj))


# ---------------------------------------------------------------------------------------
# The fake (runs anywhere, replaying a recording)
# ---------------------------------------------------------------------------------------
class FakeNVMLError(Exception):
    """Raised by the fake where the real library raised ``pynvml.NVMLError``."""

    def __init__(self, value: int, text: str = "") -> None:
        super().__init__(value)
        self.value = value
        self.text = text or f"NVML error {value}"

    def __str__(self) -> str:
        return self.text


class FakeNvmlMissingResponse(AssertionError):
    """The recording holds no response for a call the code under test made."""


@dataclass
class _Handle:
    gpu: int


class _GpmSample:
    def __init__(self) -> None:
        self.gpu: int | None = None


class _FakeMetric:
    __slots__ = ("metricId", "nvmlReturn", "value")

    def __init__(self) -> None:
        self.metricId = 0
        self.nvmlReturn = 0
        self.value = 0.0


@dataclass
class _Fault:
    gpu: int | None
    fn: str | None
    error: int
    after_calls: int
    times: int | None
    seen: int = 0
    fired: int = 0


class FakeNvml:
    """A pynvml stand-in answering from a recording; see the module docstring."""

    NVMLError = FakeNVMLError

    def __init__(self, recording: dict[str, Any] | str | Path, *, strict: bool = True,
                 init_error: int | None = None) -> None:
        data = recording if isinstance(recording, dict) else load_recording(recording)
        self.meta: dict[str, Any] = dict(data.get("meta", {}))
        self._constants: dict[str, int] = {**NVML_ERROR_CODES, **data.get("constants", {})}
        self._strict = strict
        self._init_error = init_error
        self._lock = threading.Lock()
        self._queues: dict[str, list[dict[str, Any]]] = {}
        self._pos: dict[str, int] = {}
        self._fns: set[str] = set()
        for entry in data.get("calls", []):
            self._queues.setdefault(_key(entry["fn"], entry["args"]), []).append(entry)
            self._fns.add(entry["fn"])
        self._faults: list[_Fault] = []
        self.call_counts: dict[str, int] = {}
        self.initialised = 0
        metric_max = self._constants.get("NVML_GPM_METRIC_MAX", 64)

        class _MetricsGet:  # stands in for pynvml.c_nvmlGpmMetricsGet_t
            def __init__(self) -> None:
                self.version = 0
                self.numMetrics = 0
                self.sample1: Any = None
                self.sample2: Any = None
                self.metrics = [_FakeMetric() for _ in range(metric_max)]

        self.c_nvmlGpmMetricsGet_t = _MetricsGet

    @classmethod
    def unavailable(cls, error: int = 12, text: str = "NVML Shared Library Not Found") -> FakeNvml:
        """A fake whose ``nvmlInit`` fails as on a machine without driver (12 = LIBRARY_NOT_FOUND)."""
        fake = cls({"recording_schema": RECORDING_SCHEMA, "constants": {}, "calls": []}, init_error=error)
        fake._init_text = text
        return fake

    # -- fault injection --------------------------------------------------------------
    def fail(self, *, gpu: int | None = None, fn: str | None = None, error: int = 15,
             after_calls: int = 0, times: int | None = None) -> None:
        """Make matching calls raise NVML ``error`` (15 = GPU_IS_LOST) after ``after_calls`` of them.

        ``times`` limits how many calls fail (None: all later ones), so a GPU can recover.
        """
        self._faults.append(_Fault(gpu, fn, error, after_calls, times))

    def _check_faults(self, fn: str, args: list[Any]) -> None:
        gpu = next((a["gpu"] for a in args if isinstance(a, dict) and "gpu" in a), None)
        for f in self._faults:
            if (f.gpu is None or f.gpu == gpu) and (f.fn is None or f.fn == fn):
                f.seen += 1
                if f.seen > f.after_calls and (f.times is None or f.fired < f.times):
                    f.fired += 1
                    raise FakeNVMLError(f.error, f"injected NVML error {f.error}")

    # -- replay -----------------------------------------------------------------------
    def _arg(self, arg: Any) -> Any:
        if isinstance(arg, _Handle):
            return {"gpu": arg.gpu}
        if isinstance(arg, _GpmSample):
            return _SAMPLE
        if hasattr(arg, "numMetrics") and hasattr(arg, "sample2"):
            gpu = arg.sample2.gpu if isinstance(arg.sample2, _GpmSample) else None
            return {"gpu": gpu, "metrics": [int(arg.metrics[i].metricId) for i in range(arg.numMetrics)]}
        return to_jsonable(arg)

    def _replay(self, fn: str, args: tuple[Any, ...]) -> Any:
        key_args = [self._arg(a) for a in args]
        with self._lock:
            self.call_counts[fn] = self.call_counts.get(fn, 0) + 1
            self._check_faults(fn, key_args)
            key = _key(fn, key_args)
            queue = self._queues.get(key)
            if not queue:
                if self._strict:
                    raise FakeNvmlMissingResponse(f"the NVML recording has no response to {fn}{key_args}")
                raise FakeNVMLError(self._constants.get("NVML_ERROR_NOT_SUPPORTED", 3), "Not Supported")
            i = self._pos.get(key, 0)
            entry = queue[min(i, len(queue) - 1)]
            self._pos[key] = i + 1
        if "error" in entry:
            raise FakeNVMLError(entry["error"], entry.get("error_text", ""))
        return entry.get("result")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("NVML_") or name.startswith("nvmlClocks"):
            try:
                return self.__dict__["_constants"][name]
            except KeyError:
                raise AttributeError(name) from None
        if name.startswith("nvml") and name in self.__dict__.get("_fns", ()):
            return lambda *args: _to_obj(self._replay(name, args))
        raise AttributeError(name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._constants) | self._fns)

    # Calls that create or fill objects are answered by hand, after replaying their key
    # (so a recorded error or an injected fault still applies).
    def nvmlInit(self) -> None:
        if self._init_error is not None:
            raise FakeNVMLError(self._init_error, getattr(self, "_init_text", ""))
        self._replay("nvmlInit", ())
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1
        if "nvmlShutdown" in self._fns:
            self._replay("nvmlShutdown", ())

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._replay("nvmlDeviceGetHandleByIndex", (index,))
        return _Handle(int(index))

    def nvmlGpmSampleAlloc(self) -> _GpmSample:
        self._replay("nvmlGpmSampleAlloc", ())
        return _GpmSample()

    def nvmlGpmSampleGet(self, handle: _Handle, sample: _GpmSample) -> _GpmSample:
        self._replay("nvmlGpmSampleGet", (handle, sample))
        sample.gpu = handle.gpu
        return sample

    def nvmlGpmSampleFree(self, sample: _GpmSample) -> None:
        self._replay("nvmlGpmSampleFree", (sample,))

    def nvmlGpmMetricsGet(self, mg: Any) -> Any:
        result = self._replay("nvmlGpmMetricsGet", (mg,))
        for i, m in enumerate(result["metrics"]):
            mg.metrics[i].metricId = m["metricId"]
            mg.metrics[i].nvmlReturn = m["nvmlReturn"]
            mg.metrics[i].value = m["value"]
        return mg

    def responses(self, fn: str) -> list[dict[str, Any]]:
        """All recorded entries of one function (for tests that check replayed values)."""
        return [e for q in self._queues.values() for e in q if e["fn"] == fn]
