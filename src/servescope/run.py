"""The run directory: the one place where measurement and analysis meet.

``load`` and ``telemetry`` write into a run directory while a benchmark runs; the
analysis side (``diagnose``, ``report``, ``compare``) only reads it. So a report can
be rebuilt at any time, from any machine, and a crashed run still holds everything it
recorded up to the crash. ``docs/run-directory.md`` lists every file and field.

Why these choices:
- Every JSON file carries ``schema_version``; opening a run written by an incompatible
  version is a clear ``RunSchemaMismatch`` instead of a KeyError deep in a report.
- Per-request and per-sample records are JSON Lines, appended and flushed one line at a
  time: a crash or Ctrl-C loses at most the line being written. Readers tolerate a
  truncated *last* line for that reason, but reject malformed lines elsewhere.
- All timestamps are ``time.monotonic_ns()`` (CLOCK_MONOTONIC, shared by every process on
  the machine, so a server-side stamp and a client-side one can be compared). One
  anchor pairing it with Unix time is stored in ``env.json`` to place the run in the day.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from servescope.errors import RunDataError, RunNotFound, RunSchemaMismatch

SCHEMA_VERSION = 1

CONFIG = "config.json"
ENV = "env.json"
REQUESTS = "requests.jsonl"
POINTS = "points.jsonl"
SUMMARY = "summary.json"
GPU_SAMPLES = "telemetry/gpu_samples.csv"
SERVER_SAMPLES = "telemetry/server_samples.csv"
TELEMETRY_NOTES = "telemetry/notes.json"
TELEMETRY_SUMMARY = "telemetry_summary.json"
ROOFLINE = "roofline.json"
DIAGNOSIS = "diagnosis.json"
REPORT_HTML = "report.html"
REPORT_MD = "report.md"


def now_ns() -> int:
    """The run clock: CLOCK_MONOTONIC in nanoseconds, comparable across processes."""
    return time.monotonic_ns()


def clock_anchor() -> dict[str, int]:
    """A pair of readings (monotonic, Unix) taken back to back, to date a run's clock."""
    mono = time.monotonic_ns()
    unix = time.time_ns()
    return {"monotonic_ns": mono, "unix_ns": unix}


def _dump(data: Any) -> str:
    return json.dumps(data, sort_keys=False, separators=(",", ":"), allow_nan=False, default=_json_default)


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__}")


class JsonlWriter:
    """Appends one JSON object per line and flushes each, so a crash loses nothing earlier."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh: TextIO | None = path.open("a", encoding="utf-8")

    def write(self, record: Any) -> None:
        if self._fh is None:
            raise ValueError(f"{self.path}: writer is closed")
        data = record.to_dict() if hasattr(record, "to_dict") else record
        self._fh.write(_dump(data) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class RunDir:
    """A run directory on disk. Create one with ``RunDir.create``, read one with ``RunDir.open``."""

    path: Path

    @classmethod
    def create(cls, path: str | Path, config: dict[str, Any], env: dict[str, Any] | None = None) -> RunDir:
        """Make a new run directory and write ``config.json`` (and ``env.json``) before any request.

        An existing directory that already holds a run is refused rather than mixed into.
        """
        p = Path(path)
        if (p / CONFIG).exists():
            raise RunDataError(str(p), "already holds a run; choose a new --out directory")
        p.mkdir(parents=True, exist_ok=True)
        run = cls(p)
        run.write_json(CONFIG, config)
        env = dict(env or {})
        env.setdefault("clock_anchor", clock_anchor())
        run.write_json(ENV, env)
        return run

    @classmethod
    def open(cls, path: str | Path) -> RunDir:
        """Open an existing run, checking that its schema version is one we read."""
        p = Path(path)
        if not p.is_dir():
            raise RunNotFound(str(p), "no such directory")
        if not (p / CONFIG).is_file():
            raise RunNotFound(str(p), f"not a servescope run (no {CONFIG})")
        run = cls(p)
        version = run.read_json(CONFIG).get("schema_version")
        if version != SCHEMA_VERSION:
            raise RunSchemaMismatch(
                str(p), f"schema_version {version!r}, this servescope reads {SCHEMA_VERSION}"
            )
        return run

    def file(self, name: str) -> Path:
        return self.path / name

    def exists(self, name: str) -> bool:
        return (self.path / name).exists()

    @property
    def config(self) -> dict[str, Any]:
        return self.read_json(CONFIG)

    @property
    def env(self) -> dict[str, Any]:
        return self.read_json(ENV, default={})

    def write_json(self, name: str, data: dict[str, Any]) -> Path:
        """Write a JSON file atomically (temp file + rename), stamping ``schema_version``."""
        target = self.path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        payload = {"schema_version": SCHEMA_VERSION, **{k: v for k, v in data.items() if k != "schema_version"}}
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(payload, indent=2, allow_nan=False, default=_json_default) + "\n")
        os.replace(tmp, target)
        return target

    def read_json(self, name: str, default: Any = ...) -> Any:
        target = self.path / name
        if not target.exists():
            if default is ...:
                raise RunDataError(str(target), "missing")
            return default
        try:
            return json.loads(target.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RunDataError(str(target), f"not valid JSON ({err})") from err

    def jsonl_writer(self, name: str) -> JsonlWriter:
        return JsonlWriter(self.path / name)

    def iter_jsonl(self, name: str) -> Iterator[dict[str, Any]]:
        """Yield the objects of a JSON Lines file.

        A malformed *last* line is what a crash mid-write leaves, so it is skipped; a
        malformed line anywhere else means the file was damaged and raises.
        """
        yield from read_jsonl(self.path / name)


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Yield the objects of a JSON Lines file, tolerating one truncated final line."""
    if not path.exists():
        return
    with path.open(encoding="utf-8", errors="replace") as fh:
        lines = fh.readlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            if i == len(lines) - 1 and not line.endswith("\n"):
                return  # the line being written when the run stopped
            raise RunDataError(str(path), f"line {i + 1} is not valid JSON ({err.msg})") from err
        if not isinstance(obj, dict):
            raise RunDataError(str(path), f"line {i + 1} is not a JSON object")
        yield obj
