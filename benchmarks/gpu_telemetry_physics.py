"""Does servescope's GPU telemetry move the way physics says? (issue 4, run on an H200)

One run, four phases, sampled by a real ``TelemetrySession`` (the same code a sweep uses):

1. ``idle``    nothing runs: low power, low utilisation, the ``gpu_idle`` clock-event reason;
2. ``memcpy``  large device-to-device copies: DRAM bandwidth utilisation high, tensor pipes idle;
3. ``matmul``  bf16 8192^3 matrix products: tensor (HMMA) pipes busy, power near the limit;
4. ``cooldown`` idle again.

Each phase is a sweep point in ``points.jsonl`` (measured from 1 s after the phase starts,
since NVML's averaged power lags) and a measurement window; ``timeline.summarize`` then
aggregates, and the checks below compare phases. Also measured: the energy counter's
update period, one legacy PCIe-throughput call, the sampler's own CPU cost at 10/50/100 ms
(``sampler_overhead.measure``), and ``servescope telemetry`` run as a subprocess while a
matmul loop runs. Every NVML response of the session is recorded (``RecordingNvml``) and
written as the fixture the CPU test suite replays.

    python benchmarks/gpu_telemetry_physics.py --out $OUT              # on the GPU machine
    python benchmarks/gpu_telemetry_physics.py --out /tmp/x --device cpu \\
        --fake-recording tests/telemetry/fixtures/nvml_recording_h200.json.gz   # dry run, no GPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import subprocess
import sys
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sampler_overhead
from servescope.load.records import PointRecord
from servescope.run import POINTS, RunDir, now_ns
from servescope.telemetry.fake_nvml import FakeNvml, RecordingNvml
from servescope.telemetry.nvml import Nvml, describe_gpus, load_pynvml
from servescope.telemetry.session import TelemetryConfig, TelemetrySession
from servescope.telemetry.timeline import summarize

SETTLE_S = 1.0  # NVML's averaged power needs ~1 s (../shared/reference/h200-measurements.md)


# ---------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------
class Workloads:
    def __init__(self, device: str, copy_bytes: int, matmul_n: int) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).random_(0, 255)
        self.dst = torch.empty_like(self.src)
        self.a = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device=device)
        self.b = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device=device)
        self.n = matmul_n
        self.sync()
        self.dst.copy_(self.src)  # warm-up (allocations, handles)
        _ = self.a @ self.b
        self.sync()

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    def idle(self, seconds: float) -> dict[str, Any]:
        time.sleep(seconds)
        return {}

    def memcpy(self, seconds: float) -> dict[str, Any]:
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(20):
                self.dst.copy_(self.src)
            n += 20
            self.sync()
        dt = time.perf_counter() - t0
        moved = 2.0 * self.src.numel() * n  # bytes read + bytes written
        return {"copies": n, "bytes_moved": moved, "achieved_bytes_s": moved / dt}

    def matmul(self, seconds: float) -> dict[str, Any]:
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(10):
                self.a @ self.b
            n += 10
            self.sync()
        dt = time.perf_counter() - t0
        flops = 2.0 * self.n**3 * n
        return {"matmuls": n, "flops": flops, "achieved_flops_s": flops / dt}


# ---------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------
def _g(point: dict[str, Any], key: str) -> float | None:
    gpus = point.get("gpus") or {}
    vals = [s.get(key) for s in gpus.values() if s.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def _g0(point: dict[str, Any], key: str) -> Any:
    return ((point.get("gpus") or {}).get("0") or {}).get(key)


def physics_checks(points: dict[str, dict[str, Any]], windows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Comparisons between phases that must hold if the counters mean what they say."""
    idle, mem, mm = points["idle"], points["memcpy"], points["matmul"]
    checks: list[dict[str, Any]] = []

    def check(name: str, ok: bool | None, observed: dict[str, Any], expected: str) -> None:
        checks.append({"check": name, "pass": bool(ok) if ok is not None else None, "expected": expected,
                       "observed": observed})

    def both(*vals: float | None) -> bool:
        return all(v is not None for v in vals)

    p_idle, p_mem, p_mm = _g(idle, "power_w_mean"), _g(mem, "power_w_mean"), _g(mm, "power_w_mean")
    check("power rises with load", both(p_idle, p_mem, p_mm) and p_mem > p_idle + 50 and p_mm > p_idle + 150,
          {"idle_w": p_idle, "memcpy_w": p_mem, "matmul_w": p_mm}, "memcpy > idle + 50 W, matmul > idle + 150 W")
    d_idle, d_mem, d_mm = (_g(x, "gpm_dram_bw_pct_mean") for x in (idle, mem, mm))
    check("DRAM bandwidth utilisation: memcpy high, idle low",
          both(d_idle, d_mem, d_mm) and d_mem > 40 and d_mem > 3 * max(d_idle, 1.0) and d_mem > d_mm,
          {"idle_pct": d_idle, "memcpy_pct": d_mem, "matmul_pct": d_mm}, "memcpy > 40%, > 3x idle, > matmul")
    t_idle, t_mem, t_mm = (_g(x, "gpm_tensor_active_pct_mean") for x in (idle, mem, mm))
    check("tensor pipes: matmul busy, memcpy and idle not",
          both(t_idle, t_mem, t_mm) and t_mm > 30 and t_mem < 5 and t_idle < 5,
          {"idle_pct": t_idle, "memcpy_pct": t_mem, "matmul_pct": t_mm}, "matmul > 30%, memcpy < 5%, idle < 5%")
    h_mm, i_mm = _g(mm, "gpm_hmma_active_pct_mean"), _g(mm, "gpm_imma_active_pct_mean")
    check("bf16 matmul runs on HMMA, not IMMA", both(h_mm, i_mm) and h_mm > 30 and i_mm < 1,
          {"hmma_pct": h_mm, "imma_pct": i_mm}, "HMMA > 30%, IMMA < 1%")
    u_idle, u_mem, u_mm = (_g(x, "gpu_util_pct_mean") for x in (idle, mem, mm))
    check("'utilisation' says busy under both loads", both(u_idle, u_mem, u_mm) and u_mem > 80 and u_mm > 80
          and u_idle < 20, {"idle_pct": u_idle, "memcpy_pct": u_mem, "matmul_pct": u_mm},
          "memcpy and matmul > 80%, idle < 20%")
    s_mm, smax = _g(mm, "sm_clock_mhz_mean"), _g(mm, "sm_clock_max_mhz")
    check("SM clock under matmul is positive and at most its max", both(s_mm, smax) and 0 < s_mm <= smax,
          {"matmul_sm_mhz": s_mm, "max_mhz": smax}, "0 < clock <= max")
    e_mm, dur = _g(mm, "energy_j"), mm.get("duration_s")
    ratio = (e_mm / dur / p_mm) if both(e_mm, dur, p_mm) and dur and p_mm else None
    check("energy counter agrees with sampled power (matmul)", ratio is not None and 0.85 < ratio < 1.15,
          {"energy_j": e_mm, "duration_s": dur, "counter_w": (e_mm / dur) if both(e_mm, dur) and dur else None,
           "sampled_w": p_mm, "ratio": ratio}, "counter-derived W within 15% of mean sampled W")
    mm_reasons = _g0(mm, "clock_event_reasons_fraction") or {}
    check("matmul at the power limit is power-capped: SM clock below max, sw_power_cap",
          both(s_mm, smax) and s_mm < smax and mm_reasons.get("sw_power_cap", 0) > 0.5,
          {"matmul_sm_mhz": s_mm, "max_mhz": smax, "matmul_reasons": mm_reasons},
          "clock < max and sw_power_cap in > 50% of matmul samples")
    # Per-sample GPM means must agree with one GPM reading over the whole window (the check
    # that caught intervals without a counter update being averaged in as zeros).
    for phase, col in (("matmul", "gpm_tensor_active_pct"), ("memcpy", "gpm_dram_bw_pct"),
                       ("matmul", "gpm_sm_active_pct")):
        per_sample = _g(points[phase], f"{col}_mean")
        win = ((windows.get(phase) or {}).get("gpm") or {}).get("0", {}).get(col)
        check(f"{phase}: per-sample {col} agrees with the window's GPM",
              both(per_sample, win) and abs(per_sample - win) < 5.0,
              {"per_sample_mean": per_sample, "window": win}, "within 5 percentage points")
    idle_reasons = _g0(idle, "clock_event_reasons_fraction") or {}
    check("idle: clock-event reasons (informational)", None, {"idle_reasons": idle_reasons},
          "no expectation: with a CUDA context open the H200 kept 1980 MHz and reported no reason in run 1")
    return checks


def energy_counter_period(lib: Any, seconds: float) -> dict[str, Any]:
    """Poll the energy counter and averaged power in a tight loop; how often do they change?"""
    with Nvml(lib) as nvml:
        gpu = nvml.open_gpus([0])[0]
        t_end = time.perf_counter() + seconds
        last_e = last_p = None
        e_changes: list[float] = []
        p_changes: list[float] = []
        reads = 0
        while time.perf_counter() < t_end:
            t = time.perf_counter()
            e, p = gpu.energy_j(), gpu.power_w()
            reads += 1
            if last_e is not None and e != last_e:
                e_changes.append(t)
            if last_p is not None and p != last_p:
                p_changes.append(t)
            last_e, last_p = e, p
        try:
            legacy = gpu.pcie_legacy_read_s()
        except AttributeError:  # a dry-run recording without that call
            legacy = None
        gpu.close()

    def med_gap(ts: list[float]) -> float | None:
        gaps = sorted(b - a for a, b in itertools.pairwise(ts))
        return gaps[len(gaps) // 2] if gaps else None

    return {"seconds": seconds, "reads": reads, "energy_changes": len(e_changes),
            "energy_update_median_s": med_gap(e_changes), "power_changes": len(p_changes),
            "power_update_median_s": med_gap(p_changes), "pcie_legacy_call_s": legacy}


def cli_check(out: Path, wl: Workloads, seconds: float) -> dict[str, Any]:
    """Run ``servescope telemetry`` as a subprocess while a matmul loop runs here."""
    run_dir = out / "cli_run"
    cmd = [sys.executable, "-m", "servescope", "telemetry", "--gpus", "all", "--interval-ms", "50",
           "--duration", str(seconds), "--out", str(run_dir), "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(2.0)
    wl.matmul(max(seconds - 3.0, 1.0))
    stdout, stderr = proc.communicate(timeout=seconds + 60)
    res: dict[str, Any] = {"command": " ".join(cmd[1:]), "returncode": proc.returncode, "stderr_tail": stderr[-2000:]}
    try:
        summary = json.loads(stdout)
        g0 = (summary.get("run") or {}).get("gpus", {}).get("0", {})
        res.update({k: g0.get(k) for k in ("samples", "power_w_mean", "power_w_p95", "gpm_tensor_active_pct_mean",
                                            "gpu_util_pct_mean", "energy_j", "energy_source")})
    except json.JSONDecodeError:
        res["stdout_tail"] = stdout[-2000:]
    return res


# ---------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--fake-recording", type=Path, help="dry run on CPU: replay this recording instead of NVML")
    ap.add_argument("--interval-ms", type=float, default=50.0)
    ap.add_argument("--idle-s", type=float, default=4.0)
    ap.add_argument("--load-s", type=float, default=6.0)
    ap.add_argument("--copy-gib", type=float, default=4.0)
    ap.add_argument("--matmul-n", type=int, default=8192)
    ap.add_argument("--overhead-s", type=float, default=4.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")

    def lib_factory() -> Any:
        return FakeNvml(args.fake_recording) if args.fake_recording else load_pynvml()

    recorder = RecordingNvml(lib_factory())
    wl = Workloads(args.device, int(args.copy_gib * 2**30), args.matmul_n)
    gpus = describe_gpus(recorder)
    run = RunDir.create(
        args.out / "physics_run",
        config={"command": "benchmarks/gpu_telemetry_physics.py", "argv": sys.argv[1:]},
        env={"host": platform.node(), "python": platform.python_version(), "gpus": gpus,
             "torch": wl.torch.__version__, "device": args.device},
    )
    phases = [("idle", wl.idle, args.idle_s), ("memcpy", wl.memcpy, args.load_s),
              ("matmul", wl.matmul, args.load_s), ("cooldown", wl.idle, args.idle_s)]
    phase_meta: list[dict[str, Any]] = []
    windows: list[dict[str, Any]] = []
    config = TelemetryConfig(gpus="all", interval_ms=args.interval_ms)

    def power_reads() -> int:
        return sum(1 for c in recorder.calls if c["fn"] == "nvmlDeviceGetPowerUsage")

    with TelemetrySession(run, config, nvml_lib=recorder, require_gpus=True) as session, \
            run.jsonl_writer(POINTS) as points_out:
        for i, (label, fn, seconds) in enumerate(phases):
            reads0 = power_reads()
            start = now_ns()
            session.begin_window(label)
            achieved = fn(seconds)
            wl.sync()
            w = session.end_window(label)
            end = now_ns()
            windows.append(w.to_dict())
            points_out.write(PointRecord(point=i, label=label, concurrency=None, request_rate=None, start_ns=start,
                                         measure_start_ns=start + int(SETTLE_S * 1e9), end_ns=end, num_requests=0,
                                         num_warmup=0, extra={"workload": label, **achieved}))
            phase_meta.append({"label": label, "power_reads_before": reads0, "power_reads_after": power_reads(),
                               "seconds": seconds, **achieved})
    summary = summarize(run)
    by_label = {p["label"]: p for p in summary["points"]}
    checks = physics_checks(by_label, {w["name"]: w for w in windows})

    recording_path = args.out / "nvml_recording_h200.json.gz"
    recorder.dump(recording_path, meta={
        "source": "benchmarks/gpu_telemetry_physics.py: every NVML call of describe_gpus() and of the "
                  "TelemetrySession over the idle/memcpy/matmul/cooldown phases",
        "recorded_utc": started, "host": platform.node(), "gpus": gpus, "interval_ms": args.interval_ms,
        "phases": phase_meta, "dry_run_from": str(args.fake_recording) if args.fake_recording else None,
    })
    period = energy_counter_period(lib_factory(), 1.5)
    real_or_fake = (lambda: lib_factory()) if args.fake_recording else (lambda: None)  # None: real pynvml
    overhead = sampler_overhead.measure(real_or_fake, [10.0, 50.0, 100.0], args.overhead_s)
    # Why the energy counter is read at most every 0.5 s: the same 10 ms sampler reading it every tick.
    overhead += sampler_overhead.measure(real_or_fake, [10.0], args.overhead_s, energy_period_s=0.0)
    cli = cli_check(args.out, wl, 8.0) if not args.fake_recording else {"skipped": "dry run"}

    result = {
        "date_utc": started, "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": sampler_overhead.machine(), "gpus": gpus, "dry_run": bool(args.fake_recording),
        "phases": [{"label": p["label"], "duration_s": p["duration_s"], "output": m,
                    "gpu0": (p.get("gpus") or {}).get("0")}
                   for p, m in zip(summary["points"], phase_meta, strict=True)],
        "windows": windows, "checks": checks, "energy_counter": period, "sampler_overhead": overhead, "cli": cli,
    }
    (args.out / "physics_results.json").write_text(json.dumps(result, indent=2) + "\n")
    for name in ("physics_run", "cli_run"):
        if (args.out / name).exists():
            with tarfile.open(args.out / f"{name}.tar.gz", "w:gz") as tar:
                tar.add(args.out / name, arcname=name)

    print("\n## phases (GPU 0; measured from 1 s after each phase starts)")
    print("| phase | W mean | W p95 | % limit | SM MHz | util % | tensor % | HMMA % | DRAM % | J | energy src |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for p in summary["points"]:
        g = (p.get("gpus") or {}).get("0") or {}

        def f(k: str, fmt: str = "{:.1f}", g: dict[str, Any] = g) -> str:
            return fmt.format(g[k]) if g.get(k) is not None else "-"
        print(f"| {p['label']} | {f('power_w_mean')} | {f('power_w_p95')} | {f('power_limit_pct')} | "
              f"{f('sm_clock_mhz_mean', '{:.0f}')} | {f('gpu_util_pct_mean')} | {f('gpm_tensor_active_pct_mean')} | "
              f"{f('gpm_hmma_active_pct_mean')} | {f('gpm_dram_bw_pct_mean')} | {f('energy_j', '{:.0f}')} | "
              f"{g.get('energy_source')} |")
    print("\n## checks")
    for c in checks:
        verdict = "INFO" if c["pass"] is None else ("PASS" if c["pass"] else "FAIL")
        print(f"- [{verdict}] {c['check']}: {json.dumps(c['observed'])}")
    print("\n## energy counter / power update")
    print(json.dumps(period))
    print("\n## sampler overhead")
    print(sampler_overhead.table(overhead))
    print("\n## servescope telemetry (subprocess)")
    print(json.dumps(cli)[:1500])
    return 0 if all(c["pass"] is not False for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
