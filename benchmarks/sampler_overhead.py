"""How much CPU does servescope's NVML sampler itself cost? (issue 4, item 5)

Runs ``GpuSampler`` alone (the main thread sleeps) at several intervals and reports the
sampler thread's CPU time as a share of one core, plus the wall time of one tick. On a
machine without NVML it replays a recorded NVML session through ``FakeNvml`` (this then
measures our Python per-sample cost plus the fake's own replay bookkeeping, an upper
bound of the Python part); on a GPU machine ``--real`` uses the real NVML.

    python benchmarks/sampler_overhead.py                       # fake, committed H200 recording
    python benchmarks/sampler_overhead.py --real --seconds 4    # real NVML (GPU machine)

Writes JSON to ``--out`` (if given) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from servescope.telemetry.fake_nvml import FakeNvml
from servescope.telemetry.nvml import Nvml
from servescope.telemetry.sampler import GpuSampler, GpuSampleWriter

DEFAULT_RECORDING = Path(__file__).resolve().parents[1] / "tests/telemetry/fixtures/nvml_recording_h200.json.gz"


def measure(lib_factory: Callable[[], Any], intervals_ms: list[float], seconds: float,
            gpus: str = "all", **gpu_options: float) -> list[dict[str, Any]]:
    """Run the sampler alone at each interval; return one result dict per interval.

    ``gpu_options`` go to ``NvmlGpu`` (``energy_period_s``, ``gpm_period_s``).
    """
    out = []
    for interval in intervals_ms:
        with Nvml(lib_factory()) as nvml, tempfile.TemporaryDirectory() as tmp:
            devices = nvml.open_gpus(nvml.resolve(gpus), **gpu_options)
            writer = GpuSampleWriter(Path(tmp) / "gpu_samples.csv")
            sampler = GpuSampler(devices, interval, writer)
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            sampler.start()
            time.sleep(seconds)
            sampler.stop()
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            writer.close()
            for d in devices:
                d.close()
            st = sampler.stats()
            ticks = max(st["ticks"], 1)
            process_cpu_s = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
            out.append({
                "interval_ms": interval,
                "options": dict(gpu_options),
                "gpus": len(devices),
                "seconds": st["wall_s"],
                "ticks": st["ticks"],
                "expected_ticks": int(st["wall_s"] * 1000 / interval),
                "overruns": st["overruns"],
                "thread_cpu_s": st["thread_cpu_s"],
                "cpu_pct_of_one_core": st["cpu_pct_of_one_core"],
                "process_cpu_pct_of_one_core": 100.0 * process_cpu_s / st["wall_s"],
                "tick_wall_ms": 1000.0 * st["tick_time_s"] / ticks,
                "tick_cpu_ms": 1000.0 * st["thread_cpu_s"] / ticks,
                "tick_cpu_ms_per_gpu": 1000.0 * st["thread_cpu_s"] / ticks / max(len(devices), 1),
            })
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| interval ms | options | GPUs | ticks (expected) | overruns | sampler CPU % of one core | "
        "tick wall ms | tick CPU ms | CPU ms per GPU per sample |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['interval_ms']:g} | {_opts(r.get('options'))} | {r['gpus']} | "
            f"{r['ticks']} ({r['expected_ticks']}) | {r['overruns']} | "
            f"{r['cpu_pct_of_one_core']:.2f} | {r['tick_wall_ms']:.3f} | {r['tick_cpu_ms']:.3f} | "
            f"{r['tick_cpu_ms_per_gpu']:.3f} |"
        )
    return "\n".join(lines)


def _opts(options: dict[str, Any] | None) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in (options or {}).items()) or "defaults"


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        nproc = int(subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, ValueError, subprocess.CalledProcessError):
        nproc = None
    return {"host": platform.node(), "cpu": cpu, "cores": nproc, "python": platform.python_version(),
            "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", action="store_true", help="use the real NVML (GPU machine)")
    ap.add_argument("--recording", type=Path, default=DEFAULT_RECORDING, help="NVML recording for the fake")
    ap.add_argument("--intervals", default="10,50,100", help="comma-separated intervals in ms")
    ap.add_argument("--seconds", type=float, default=4.0, help="seconds per interval")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args()
    intervals = [float(x) for x in args.intervals.split(",")]
    if args.real:
        factory: Callable[[], Any] = lambda: None  # noqa: E731 - None means the real pynvml
        source = "real NVML"
    else:
        factory = lambda: FakeNvml(args.recording)  # noqa: E731
        source = f"FakeNvml replaying {args.recording.name}"
    rows = measure(factory, intervals, args.seconds)
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "nvml": source, "machine": machine(),
              "results": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"# sampler overhead ({source}; {result['machine']['cpu']}, {result['machine']['date_utc']})")
    print(table(rows))


if __name__ == "__main__":
    main()
