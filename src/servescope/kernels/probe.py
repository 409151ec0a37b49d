"""Measure MoE expert GEMMs on the local GPU: every backend, every tokens-per-expert point, against the roofline.

For each (shape, dtype, tokens per expert) the probe:
1. draws fresh random activations (weights are drawn once per shape and dtype, in enough rotated copies
   that consecutive calls never find their weights in L2: decode streams expert weights from HBM);
2. checks every backend against a float32 reference on poisoned outputs; a wrong backend is reported
   wrong and not timed;
3. captures the backend's calls over all copies in a CUDA graph (so per-expert loops are timed without
   Python launch overhead, as engines run them) and replays it back to back for at least ``window_s``,
   timing every replay with CUDA events (median reported) while NVML reads power, clocks and GPM activity
   over the same steady window;
4. divides the two numbers (FLOPs, minimum bytes; ``cost.py``) by ceilings measured in the same run (a
   large device-to-device copy, a large GEMM) to get the roofline and the % of it reached.

Everything touching torch is imported lazily, after ``require_gpu`` has said a GPU is there, so that
``servescope kernels`` on a CPU machine fails with one line instead of an import error.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import logging
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servescope import __version__
from servescope.errors import ConfigError, KernelProbeError, UnknownNameError
from servescope.kernels.cost import Ceilings, check_dtype, datasheet_ceilings, gemm_cost
from servescope.kernels.plots import plot_results
from servescope.kernels.results import KernelPoint, KernelResults, WindowTelemetry, write_results
from servescope.kernels.shapes import ExpertShape, GemmShape, expert_shape

log = logging.getLogger(__name__)

DEFAULT_TOKENS_PER_EXPERT = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

Progress = Callable[[str], None]


def require_gpu(device_index: int = 0) -> Any:
    """Return the torch module if a CUDA GPU is usable, else raise KernelProbeError saying why in one line."""
    try:
        torch = importlib.import_module("torch")
    except ModuleNotFoundError as err:
        raise KernelProbeError(
            "PyTorch is not installed; servescope kernels needs torch with CUDA on a machine with an NVIDIA GPU"
        ) from err
    if not torch.cuda.is_available():
        raise KernelProbeError(
            "no CUDA GPU visible (torch.cuda.is_available() is False); run servescope kernels on a machine "
            "with an NVIDIA GPU"
        )
    if device_index >= torch.cuda.device_count():
        raise KernelProbeError(f"GPU {device_index} not visible; {torch.cuda.device_count()} GPU(s) present")
    return torch


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    """What to measure. ``backends`` None means every backend of each dtype."""

    shapes: tuple[GemmShape, ...]
    dtypes: tuple[str, ...] = ("bf16",)
    tokens_per_expert: tuple[int, ...] = DEFAULT_TOKENS_PER_EXPERT
    backends: tuple[str, ...] | None = None
    window_s: float = 1.0
    rotation_bytes: int | None = None  # default: 8 x the L2 size
    device_index: int = 0
    seed: int = 0
    command: str = ""
    triton_configs: dict[int, Any] = field(default_factory=dict)  # tokens/expert -> TritonConfig (tuning)

    def __post_init__(self) -> None:
        for dtype in self.dtypes:
            check_dtype(dtype)
        if not self.shapes:
            raise ConfigError("no expert shape to probe; give --model or --hidden/--expert-width/--experts")
        if not self.tokens_per_expert or min(self.tokens_per_expert) < 1:
            raise ConfigError("--tokens-per-expert needs positive integers, e.g. 1,2,4,...,1024")
        if self.window_s < 0:
            raise ConfigError("--window-s must be >= 0")


@dataclass(frozen=True, slots=True)
class Timing:
    """Per-call times of one backend at one point (microseconds) and the window's NVML readings."""

    median_us: float
    p10_us: float
    p90_us: float
    calls: int
    graph: bool
    telemetry: WindowTelemetry | None


def _percentile(sorted_values: list[float], q: float) -> float:
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[idx]


class Timer:
    """Times a backend's runner with CUDA graphs and events; one per probe (holds the NVML reader)."""

    def __init__(self, torch: Any, device: Any, reader: Any | None) -> None:
        self.torch = torch
        self.device = device
        self.reader = reader

    def _event_ms(self, fn: Callable[[], object]) -> float:
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))

    def _capture(self, run: Callable[[int], object], copies: int, inner: int) -> Any | None:
        torch = self.torch
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for i in range(copies):
                run(i)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                for _ in range(inner):
                    for i in range(copies):
                        run(i)
        except RuntimeError as err:  # a backend that syncs or allocates on the host cannot be captured
            log.info("graph capture failed (%s); timing eagerly", str(err).splitlines()[0] if str(err) else err)
            torch.cuda.synchronize(self.device)
            return None
        return graph

    def time(self, run: Callable[[int], object], copies: int, *, window_s: float, min_steps: int = 20,
             target_step_us: float = 300.0) -> Timing:
        """Median per-call time of ``run`` over all input copies, plus telemetry over >= ``window_s``.

        One step = one graph replay of ``inner`` rounds over every copy (``inner`` picked so a step lasts
        about ``target_step_us``: event overhead stays negligible for tiny calls).
        """
        torch = self.torch
        for i in range(copies):  # warm-up (and compilation) outside anything timed
            run(i)
        torch.cuda.synchronize(self.device)
        est_ms = min(self._event_ms(lambda: [run(i) for i in range(copies)]) for _ in range(3)) / copies
        inner = int(max(1, min(64, math.ceil(target_step_us / 1000.0 / max(est_ms * copies, 1e-6)))))
        graph = self._capture(run, copies, inner)
        captured = graph is not None
        if graph is None:
            inner = 1

            def step() -> None:
                for i in range(copies):
                    run(i)
        else:
            step = graph.replay
        for _ in range(3):
            step()
        torch.cuda.synchronize(self.device)
        times_ms, telemetry = self._steady_loop(step, window_s=window_s, min_steps=min_steps)
        per_call_us = sorted(t * 1000.0 / (inner * copies) for t in times_ms)
        del graph
        return Timing(median_us=statistics.median(per_call_us), p10_us=_percentile(per_call_us, 0.1),
                      p90_us=_percentile(per_call_us, 0.9), calls=len(per_call_us) * inner * copies,
                      graph=captured, telemetry=telemetry)

    def _steady_loop(self, step: Callable[[], object], *, window_s: float, min_steps: int,
                     lead_s: float = 0.05, queue_depth: int = 8) -> tuple[list[float], WindowTelemetry | None]:
        """Replay ``step`` back to back; the NVML window opens after ``lead_s`` of load and closes while
        ``queue_depth`` steps are still queued, so it only ever sees a busy GPU."""
        torch = self.torch
        reader = self.reader if window_s > 0 else None
        starts: list[Any] = []
        ends: list[Any] = []
        t0 = time.perf_counter()
        window_open_at: float | None = None
        last_poll = 0.0
        telemetry = None
        i = 0
        while True:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            starts.append(start)
            ends.append(end)
            if i >= queue_depth:
                ends[i - queue_depth].synchronize()
            now = time.perf_counter()
            i += 1
            if window_s <= 0:
                if i >= min_steps:
                    break
                continue
            if window_open_at is None:
                if now - t0 >= lead_s:
                    window_open_at = now
                    last_poll = now
                    if reader is not None:
                        reader.begin()
                continue
            if reader is not None and now - last_poll >= 0.1:
                reader.poll()
                last_poll = now
            if now - window_open_at >= window_s and i >= min_steps:
                telemetry = reader.end() if reader is not None else WindowTelemetry(window_s=now - window_open_at)
                break
        torch.cuda.synchronize(self.device)
        return [float(s.elapsed_time(e)) for s, e in zip(starts, ends, strict=True)], telemetry


def measure_copy_bandwidth(torch: Any, device: Any, *, nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written (METHOD.md's ceiling)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    del src, dst
    return 2.0 * nbytes / statistics.median(times)


def measure_matmul_rate(torch: Any, device: Any, dtype: str, *, size: int = 8192, reps: int = 10) -> float | None:
    """Large square GEMM rate in FLOP/s on random data (bf16: torch.mm; fp8: torch._scaled_mm, the faster of
    fast and exact accumulation). None when the dtype has no GEMM here."""
    gen = torch.Generator(device=device).manual_seed(1)
    a = torch.randn((size, size), dtype=torch.bfloat16, device=device, generator=gen)
    b = torch.randn((size, size), dtype=torch.bfloat16, device=device, generator=gen)
    if dtype == "bf16":
        fns = [lambda: torch.mm(a, b.t())]
    elif dtype == "fp8":
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), dtype=torch.float32, device=device)
        fns = [lambda fast=fast: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                  use_fast_accum=fast) for fast in (False, True)]
    else:
        return None
    best = 0.0
    for fn in fns:
        try:
            for _ in range(3):
                fn()
            torch.cuda.synchronize(device)
            times = []
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1000.0)
        except RuntimeError as err:
            log.warning("%s matmul ceiling could not be measured: %s", dtype, err)
            continue
        best = max(best, 2.0 * size**3 / statistics.median(times))
    return best or None


def _gpu_facts(torch: Any, device: Any, reader: Any | None) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(device)
    facts: dict[str, Any] = {
        "name": props.name,
        "index": device.index,
        "capability": f"{props.major}.{props.minor}",
        "sms": props.multi_processor_count,
        "memory_bytes": int(props.total_memory),
        "l2_bytes": int(getattr(props, "L2_cache_size", 0) or 0),
    }
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        facts["uuid"] = str(uuid)
    if reader is not None:
        facts.update(reader.device_facts())
    return facts


def _software(torch: Any) -> dict[str, Any]:
    sw: dict[str, Any] = {"servescope": __version__, "python": platform.python_version(), "torch": torch.__version__,
                          "cuda": torch.version.cuda}
    spec = importlib.util.find_spec("triton")
    if spec is not None:
        sw["triton"] = importlib.import_module("triton").__version__
    return sw


def _point(base: dict[str, Any], *, status: str, reason: str = "", correct: bool | None = None,
           rel_error: float | None = None) -> KernelPoint:
    return KernelPoint(**base, status=status, reason=reason, correct=correct, rel_error=rel_error)


def _timed_point(base: dict[str, Any], timing: Timing, rel_error: float | None, ideal_s: float,
                 ideal_peak_s: float | None, bound: str) -> KernelPoint:
    t_s = timing.median_us / 1e6
    tel = timing.telemetry
    return KernelPoint(
        **base, status="ok", correct=True, rel_error=rel_error, time_us=timing.median_us,
        time_us_p10=timing.p10_us, time_us_p90=timing.p90_us, timed_calls=timing.calls,
        ideal_time_us=ideal_s * 1e6, bound=bound,
        achieved_tflops=base["flops"] / t_s / 1e12, achieved_gb_s=base["bytes"] / t_s / 1e9,
        pct_of_roofline=100.0 * ideal_s / t_s,
        pct_of_peak=100.0 * ideal_peak_s / t_s if ideal_peak_s else None,
        graph=timing.graph,
        power_w=tel.power_w if tel else None, energy_j=tel.energy_j if tel else None,
        sm_clock_mhz=tel.sm_clock_mhz if tel else None, gpu_util_pct=tel.gpu_util_pct if tel else None,
        gpm_tensor_pct=tel.gpm_tensor_pct if tel else None, gpm_dram_bw_pct=tel.gpm_dram_bw_pct if tel else None,
        gpm_sm_util_pct=tel.gpm_sm_util_pct if tel else None, telemetry_window_s=tel.window_s if tel else None,
        clock_event_reasons=tel.clock_event_reasons if tel else (),
    )


def run_probe(config: ProbeConfig, *, progress: Progress | None = None) -> KernelResults:
    """Measure every requested point on the local GPU and return the results (nothing written to disk)."""
    say = progress or (lambda _msg: None)
    torch = require_gpu(config.device_index)
    from servescope.kernels import backends as bk  # torch is importable: safe now
    from servescope.kernels.nvml_window import NvmlWindowReader

    device = torch.device("cuda", config.device_index)
    torch.cuda.set_device(device)
    props = torch.cuda.get_device_properties(device)
    reader = NvmlWindowReader(uuid=str(getattr(props, "uuid", "") or "") or None, index=config.device_index)
    warnings: list[str] = list(reader.notes)
    try:
        gpu = _gpu_facts(torch, device, reader if reader.available else None)
        say(f"GPU: {gpu['name']} ({gpu['sms']} SMs, L2 {gpu['l2_bytes'] / 2**20:.0f} MiB)")
        copy_bw = measure_copy_bandwidth(torch, device)
        rates = {}
        for dtype in config.dtypes:
            rate = measure_matmul_rate(torch, device, dtype)
            if rate:
                rates[dtype] = rate
        ceilings = Ceilings(bandwidth_bytes_s=copy_bw, matmul_flops_s=rates, source="measured")
        say(f"ceilings: copy {copy_bw / 1e12:.2f} TB/s; "
            + ", ".join(f"{d} {r / 1e12:.0f} TFLOP/s" for d, r in rates.items()))
        datasheet = datasheet_ceilings(gpu["name"])
        unavailable = bk.external_library_status()
        points: list[KernelPoint] = []
        timer = Timer(torch, device, reader if reader.available else None)
        l2_bytes = gpu["l2_bytes"] or 50 * 2**20
        rotation_bytes = config.rotation_bytes or 8 * l2_bytes
        gen = torch.Generator(device=device).manual_seed(config.seed)
        for shape in config.shapes:
            for dtype in config.dtypes:
                points.extend(_probe_shape_dtype(torch, bk, timer, config, shape, dtype, ceilings, datasheet,
                                                 rotation_bytes, gen, device, say, unavailable))
        if not any(p.status == "ok" for p in points):
            warnings.append("no backend produced a timed point")
        # the reader notes window problems as they happen (short window, counters that did not advance)
        warnings.extend(note for note in reader.notes if note not in warnings)
        return KernelResults(
            gpu=gpu, software=_software(torch), ceilings=ceilings, datasheet=datasheet, points=tuple(points),
            command=config.command, created_unix_s=time.time(), unavailable=unavailable, warnings=tuple(warnings),
        )
    finally:
        reader.close()


def _probe_shape_dtype(torch: Any, bk: Any, timer: Timer, config: ProbeConfig, shape: GemmShape, dtype: str,
                       ceilings: Ceilings, datasheet: Ceilings | None, rotation_bytes: int, gen: Any, device: Any,
                       say: Progress, unavailable: dict[str, str]) -> list[KernelPoint]:
    specs = bk.backend_specs(dtype, config.backends)
    points: list[KernelPoint] = []
    runnable = []
    for spec in specs:
        why = bk.unavailable_reason(spec, shape, device)
        if why:
            unavailable[f"{spec.name} ({dtype})"] = why
        else:
            runnable.append(spec)
    if dtype == "nvfp4" or not runnable:
        unavailable.setdefault(f"all ({dtype})", "no nvfp4 backend on this GPU (NVFP4 needs Blackwell, sm_100+)"
                               if dtype == "nvfp4" else "no backend available for this dtype here")
        return points
    per_copy = shape.local_experts * shape.n * shape.k * (2 if dtype == "bf16" else 1)
    copies = max(1, math.ceil(rotation_bytes / per_copy))
    say(f"{shape.label} {dtype}: {per_copy / 2**20:.0f} MiB of weights x {copies} cop{'y' if copies == 1 else 'ies'}")
    weights = bk.make_weights(shape, dtype, copies=copies, device=device, generator=gen)
    try:
        for tpe in config.tokens_per_expert:
            acts = bk.make_activations(shape, dtype, tpe, copies=copies, device=device, generator=gen)
            problem = bk.Problem(shape=shape, dtype=dtype, tokens_per_expert=tpe, weights=weights, acts=acts)
            refs: dict[tuple[str | None, bool], Any] = {}
            for spec in runnable:
                points.append(_probe_backend(torch, bk, timer, config, problem, spec, ceilings, datasheet, refs,
                                             say))
            del problem, acts, refs
    finally:
        del weights
        torch.cuda.empty_cache()
    return points


def _probe_backend(torch: Any, bk: Any, timer: Timer, config: ProbeConfig, problem: Any, spec: Any,
                   ceilings: Ceilings, datasheet: Ceilings | None, refs: dict[tuple[str | None, bool], Any],
                   say: Progress) -> KernelPoint:
    shape, dtype, tpe = problem.shape, problem.dtype, problem.tokens_per_expert
    cost = gemm_cost(shape, dtype, tpe, fused_silu=spec.fused_silu)
    base = {"backend": spec.name, "dtype": dtype, "model": shape.model, "gemm": shape.gemm, "n": shape.n,
            "k": shape.k, "local_experts": shape.local_experts, "tokens_per_expert": tpe, "flops": cost.flops,
            "bytes": cost.total_bytes}
    key = (spec.scales, spec.fused_silu)
    try:
        if key not in refs:
            refs[key] = bk.reference(problem, spec, 0)
        runner, in_place = bk.build_runner(spec, problem, triton_config=config.triton_configs.get(tpe))
        correct, rel, reason = bk.check_backend(spec, problem, runner, in_place, refs[key])
        if not correct:
            status = "error" if reason.startswith("error:") else "wrong"
            say(f"  {spec.name:<24} M={tpe:<5} {status.upper()}: {reason}")
            return _point(base, status=status, reason=reason, correct=False if status == "wrong" else None,
                          rel_error=rel)
        timing = timer.time(runner, problem.copies, window_s=config.window_s)
    except RuntimeError as err:  # CUDA OOM, a kernel failing only under capture, ...
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        say(f"  {spec.name:<24} M={tpe:<5} ERROR: {msg[:200]}")
        torch.cuda.synchronize()
        return _point(base, status="error", reason=f"error: {msg[:300]}")
    ideal_s = ceilings.ideal_time_s(cost, dtype)
    ideal_peak_s = datasheet.ideal_time_s(cost, dtype) if datasheet else None
    point = _timed_point(base, timing, rel, ideal_s, ideal_peak_s, ceilings.bound(cost, dtype))
    tel = ""
    if point.power_w is not None:
        tel = f" {point.power_w:.0f} W"
    if point.gpm_tensor_pct is not None:
        tel += f" tensor {point.gpm_tensor_pct:.0f}% dram {point.gpm_dram_bw_pct or 0:.0f}%"
    say(f"  {spec.name:<24} M={tpe:<5} {point.time_us:9.1f} us {point.achieved_gb_s:7.0f} GB/s "
        f"{point.achieved_tflops:6.1f} TFLOP/s {point.pct_of_roofline:5.1f}% roofline{tel}")
    return point


@dataclass(frozen=True, slots=True)
class KernelsRequest:
    """What ``servescope kernels`` was asked, before any lookup (the CLI builds this from its flags)."""

    models: tuple[str, ...] = ()
    custom: ExpertShape | None = None
    tp: int = 1
    ep: int = 1
    gemms: tuple[str, ...] = ("gate_up",)
    dtypes: tuple[str, ...] = ("bf16",)
    tokens_per_expert: tuple[int, ...] = DEFAULT_TOKENS_PER_EXPERT
    backends: tuple[str, ...] | None = None
    window_s: float = 1.0
    out: Path | None = None
    device_index: int = 0
    command: str = ""
    plots: bool = True


def resolve_shapes(request: KernelsRequest) -> tuple[GemmShape, ...]:
    """The GEMM shapes one GPU runs for the requested models (or custom shape), TP and EP."""
    experts: list[ExpertShape] = [expert_shape(m) for m in request.models]
    if request.custom is not None:
        experts.append(request.custom)
    if not experts:
        raise ConfigError("give --model NAME (see `servescope models`) or --hidden, --expert-width and --experts")
    return tuple(e.gemm(g, tp=request.tp, ep=request.ep) for e in experts for g in request.gemms)


def run_kernels(request: KernelsRequest, *, progress: Progress | None = None) -> tuple[KernelResults, Path | None]:
    """The whole ``servescope kernels`` command: check for a GPU first (so a CPU machine gets that one line),
    resolve shapes, probe, and write ``kernels.json``, ``kernels.md`` and plots when ``out`` is given."""
    require_gpu(request.device_index)
    if request.backends is not None:
        from servescope.kernels.backends import known_backend_names

        known = known_backend_names()
        for name in request.backends:
            if name not in known:
                raise UnknownNameError("kernel backend", name, difflib.get_close_matches(name, known, n=3))
    config = ProbeConfig(
        shapes=resolve_shapes(request), dtypes=request.dtypes, tokens_per_expert=request.tokens_per_expert,
        backends=request.backends, window_s=request.window_s, device_index=request.device_index,
        command=request.command,
    )
    results = run_probe(config, progress=progress)
    path = None
    if request.out is not None:
        path = write_results(request.out, results)
        if request.plots:
            plot_results(results, request.out)
    return results, path
