"""Kernel probe results: the records, the results file (``kernels.json``) and its Markdown rendering.

``servescope kernels --out DIR`` writes ``DIR/kernels.json`` (every point, the ceilings it is measured
against, the GPU and software it ran on) and ``DIR/kernels.md`` (the same as tables). Analysis
(``calibration.py``, ``servescope roofline --calibrate``) reads only the JSON, so curves measured on one
machine can be used on another. No torch here: the CPU tests write and read these files.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from servescope.errors import RunDataError
from servescope.kernels.cost import Ceilings
from servescope.run import SCHEMA_VERSION, RunDir

RESULTS_FILE = "kernels.json"
MARKDOWN_FILE = "kernels.md"

#: Point status values. ``ok``: checked correct, then timed. ``wrong``: output differs from the float32
#: reference (or has unwritten/NaN elements), so it was not timed. ``error``: the backend raised (e.g. a
#: shape it does not support). ``unavailable``: not installed / not supported on this GPU.
STATUSES = ("ok", "wrong", "error", "unavailable")


@dataclass(frozen=True, slots=True)
class WindowTelemetry:
    """NVML readings over the steady loop of one point (None where the GPU or driver does not offer it).

    ``power_w`` is the energy-counter difference over the window divided by its length (not an average of
    NVML's own 1 s averaged power readings, which lag); GPM activities are NVML's own window averages.
    """

    window_s: float
    power_w: float | None = None
    energy_j: float | None = None
    sm_clock_mhz: float | None = None
    gpu_util_pct: float | None = None
    gpm_tensor_pct: float | None = None
    gpm_dram_bw_pct: float | None = None
    gpm_sm_util_pct: float | None = None
    clock_event_reasons: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class KernelPoint:
    """One (backend, dtype, shape, tokens per expert) measurement.

    ``time_us`` is the median of CUDA-event timings of graph replays, divided by the calls per replay.
    ``pct_of_roofline`` is ideal time / measured time x 100 against the ceilings *measured in the same run*
    (copy bandwidth, large-GEMM rate); ``pct_of_peak`` the same against datasheet ceilings when known.
    """

    backend: str
    dtype: str
    model: str
    gemm: str
    n: int
    k: int
    local_experts: int
    tokens_per_expert: int
    status: str
    reason: str = ""
    correct: bool | None = None
    rel_error: float | None = None
    time_us: float | None = None
    time_us_p10: float | None = None
    time_us_p90: float | None = None
    timed_calls: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    ideal_time_us: float | None = None
    bound: str = ""
    achieved_tflops: float | None = None
    achieved_gb_s: float | None = None
    pct_of_roofline: float | None = None
    pct_of_peak: float | None = None
    graph: bool = False
    power_w: float | None = None
    energy_j: float | None = None
    sm_clock_mhz: float | None = None
    gpu_util_pct: float | None = None
    gpm_tensor_pct: float | None = None
    gpm_dram_bw_pct: float | None = None
    gpm_sm_util_pct: float | None = None
    telemetry_window_s: float | None = None
    clock_event_reasons: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["clock_event_reasons"] = list(self.clock_event_reasons)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KernelPoint:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["clock_event_reasons"] = tuple(kwargs.get("clock_event_reasons") or ())
        return cls(**kwargs)


@dataclass(frozen=True, slots=True)
class KernelResults:
    """Everything one probe run produced: where it ran, what it was measured against, and every point."""

    gpu: dict[str, Any]
    software: dict[str, Any]
    ceilings: Ceilings
    datasheet: Ceilings | None
    points: tuple[KernelPoint, ...]
    command: str = ""
    created_unix_s: float = 0.0
    unavailable: dict[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "servescope.kernels",
            "schema_version": SCHEMA_VERSION,
            "created_unix_s": self.created_unix_s,
            "command": self.command,
            "gpu": self.gpu,
            "software": self.software,
            "ceilings": self.ceilings.to_dict(),
            "datasheet": self.datasheet.to_dict() if self.datasheet else None,
            "unavailable": dict(self.unavailable),
            "warnings": list(self.warnings),
            "points": [p.to_dict() for p in self.points],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, path: str = "<data>") -> KernelResults:
        if data.get("kind") != "servescope.kernels":
            raise RunDataError(path, "not a servescope kernels results file (kind is not 'servescope.kernels')")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise RunDataError(path, f"schema_version {data.get('schema_version')!r}, this servescope reads "
                                     f"{SCHEMA_VERSION}; re-run servescope kernels")
        try:
            return cls(
                gpu=dict(data.get("gpu") or {}),
                software=dict(data.get("software") or {}),
                ceilings=Ceilings.from_dict(data["ceilings"]),
                datasheet=Ceilings.from_dict(data["datasheet"]) if data.get("datasheet") else None,
                points=tuple(KernelPoint.from_dict(p) for p in data.get("points") or ()),
                command=str(data.get("command", "")),
                created_unix_s=float(data.get("created_unix_s", 0.0)),
                unavailable={str(k): str(v) for k, v in (data.get("unavailable") or {}).items()},
                warnings=tuple(str(w) for w in data.get("warnings") or ()),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise RunDataError(path, f"malformed kernels results ({err!r})") from err

    def merged(self, other: KernelResults) -> KernelResults:
        """Points of both runs under this run's ceilings (for a benchmark split over several calls)."""
        return KernelResults(
            gpu=self.gpu, software=self.software, ceilings=self.ceilings, datasheet=self.datasheet,
            points=self.points + other.points, command=self.command, created_unix_s=self.created_unix_s,
            unavailable={**self.unavailable, **other.unavailable}, warnings=self.warnings + other.warnings,
        )


def write_results(out_dir: str | Path, results: KernelResults) -> Path:
    """Write ``kernels.json`` and ``kernels.md`` into ``out_dir`` (created if needed); returns the JSON path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = RunDir(out).write_json(RESULTS_FILE, results.to_dict())
    (out / MARKDOWN_FILE).write_text(render_markdown(results), encoding="utf-8")
    return path


def results_path(path: str | Path) -> Path:
    """The results file for a path that is either the file itself or the directory holding it."""
    p = Path(path)
    if p.is_dir():
        p = p / RESULTS_FILE
    if not p.is_file():
        raise RunDataError(str(p), "no kernels results here; run `servescope kernels --out DIR` first")
    return p


def read_results(path: str | Path) -> KernelResults:
    """Read a results file (or the directory that holds ``kernels.json``)."""
    p = results_path(path)
    data = RunDir(p.parent).read_json(p.name)
    if not isinstance(data, dict):
        raise RunDataError(str(p), "not a JSON object")
    return KernelResults.from_dict(data, path=str(p))


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def render_markdown(results: KernelResults) -> str:
    """Tables per (model, gemm, dtype): one row per tokens-per-expert, one column group per backend."""
    lines: list[str] = []
    gpu = results.gpu
    bw = results.ceilings.bandwidth_bytes_s
    rates = results.ceilings.matmul_flops_s
    lines.append(f"# MoE expert GEMMs on {gpu.get('name', 'GPU')}")
    lines.append("")
    lines.append(
        f"Measured ceilings (same run): copy bandwidth {bw / 1e12:.2f} TB/s (read + write); "
        + ", ".join(f"{d} matmul {r / 1e12:.0f} TFLOP/s" for d, r in sorted(rates.items()))
        + ". % roofline = ideal time / measured time against these."
    )
    if results.datasheet:
        ds = results.datasheet
        lines.append(
            f"Datasheet: {ds.bandwidth_bytes_s / 1e12:.2f} TB/s, "
            + ", ".join(f"{d} {r / 1e12:.0f} TFLOP/s dense" for d, r in sorted(ds.matmul_flops_s.items()))
            + "."
        )
    sw = results.software
    lines.append("Software: " + ", ".join(f"{k} {v}" for k, v in sw.items()) + ".")
    if results.command:
        lines.append(f"Command: `{results.command}`")
    lines.append("")
    for name, why in sorted(results.unavailable.items()):
        lines.append(f"- backend `{name}` not measured: {why}")
    for warning in results.warnings:
        lines.append(f"- warning: {warning}")
    if results.unavailable or results.warnings:
        lines.append("")

    groups: dict[tuple[str, str, str], list[KernelPoint]] = {}
    for p in results.points:
        groups.setdefault((p.model, p.gemm, p.dtype), []).append(p)
    for (model, gemm, dtype), pts in groups.items():
        first = pts[0]
        lines.append(f"## {model} {gemm}, {dtype}: {first.local_experts} experts x [M, {first.k}] x [{first.k}, "
                     f"{first.n}]")
        lines.append("")
        lines.append("| backend | M/expert | status | us | TFLOP/s | GB/s | % roofline | bound | W | SM MHz | "
                     "util % | GPM tensor % | GPM DRAM % | rel err |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for p in sorted(pts, key=lambda q: (q.backend, q.tokens_per_expert)):
            status = p.status if p.status == "ok" else f"**{p.status}**"
            lines.append(
                f"| {p.backend} | {p.tokens_per_expert} | {status} | {_fmt(p.time_us)} | {_fmt(p.achieved_tflops)} | "
                f"{_fmt(p.achieved_gb_s, 0)} | {_fmt(p.pct_of_roofline)} | {p.bound} | {_fmt(p.power_w, 0)} | "
                f"{_fmt(p.sm_clock_mhz, 0)} | {_fmt(p.gpu_util_pct, 0)} | {_fmt(p.gpm_tensor_pct)} | "
                f"{_fmt(p.gpm_dram_bw_pct)} | {'-' if p.rel_error is None else f'{p.rel_error:.1e}'} |"
            )
        reasons = sorted({(p.backend, p.reason) for p in pts if p.status != "ok" and p.reason})
        if reasons:
            lines.append("")
            for backend, reason in reasons:
                lines.append(f"- `{backend}`: {reason}")
        lines.append("")
    return "\n".join(lines)
