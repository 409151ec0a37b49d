"""Builds realistic run directories for the report tests, as real files written through RunDir.

The numbers are SYNTHETIC, shaped like the seed's sweep (GLM-5 NVFP4 on 8 RTX PRO 6000:
~700 / 1,100 / 1,600 / 1,640 output tok/s at 256 / 512 / 1,024 / 2,048 concurrent requests,
a 1,024 running-request cap, ~235 W of 600 W at 100% utilisation, an ITL tail of stalls).
They are not measurements; they exercise every section of the report with plausible
magnitudes. Requests are simulated per slot: each of ``min(concurrency, cap)`` slots
streams one request after another, each token ``running / target_tok_s`` seconds apart, in
chunks; requests past the cap wait for a free slot (TTFT grows, TPOT does not).
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from servescope import diagnose, roofline
from servescope import run as rundir
from servescope.load import metrics
from servescope.load.records import PointRecord, RequestRecord
from servescope.run import RunDir
from servescope.telemetry import timeline
from servescope.telemetry.sampler import GPU_COLUMNS

MALICIOUS = "<script>alert(1)</script>"
END_AFTER_LAST_CHUNK_NS = 1_000_000  # the usage chunk and [DONE] after the last token
T0_NS = 5_000_000_000_000  # an arbitrary CLOCK_MONOTONIC origin, as on a machine up for ~1.4 h


@dataclass
class RunSpec:
    concurrencies: tuple[int, ...] = (256, 512, 1024, 2048)
    tok_s: tuple[float, ...] = (704.0, 1106.0, 1601.0, 1640.0)
    running_cap: int = 1024
    output_len: int = 128
    prompt_len: int = 128
    chunk_tokens: int = 2
    requests_per_slot: int = 1
    warmup: int = 8
    gpus: int = 2
    gpu_name: str = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    model_name: str = "glm-5-nvfp4 (synthetic)"
    stall_prob: float = 0.015
    failures: int = 2  # failed requests at the last point, with error texts
    malicious: bool = False  # put MALICIOUS into every file-sourced string field
    with_summary: bool = True  # load.metrics.summarize_run, as servescope run does
    with_telemetry: bool = True  # raw CSVs + telemetry.timeline.summarize
    with_roofline: bool = True  # servescope.roofline.decode_sweep
    diagnosis: str = "synthetic"  # "synthetic" (hand-written, may carry MALICIOUS), "real" (diagnose.py), "none"
    sample_interval_s: float = 0.5
    seed: int = 1
    extra_config: dict = field(default_factory=dict)


def _text(spec: RunSpec, plain: str) -> str:
    return f"{plain} {MALICIOUS}" if spec.malicious else plain


def build_run(path: Path, spec: RunSpec | None = None) -> RunDir:
    """Write a complete run directory at ``path``; returns it opened."""
    spec = spec or RunSpec()
    rng = random.Random(spec.seed)
    config = {
        "name": _text(spec, "synthetic seed-shaped sweep"),
        "target": {"url": _text(spec, "http://127.0.0.1:30000"), "backend": "openai",
                   "model": _text(spec, spec.model_name), "engine": "sglang"},
        "workload": {"input_len": spec.prompt_len, "output_len": spec.output_len, "dataset": "random"},
        "sweep": {"concurrency": list(spec.concurrencies)},
        "command_line": ["servescope", "run", "--concurrency", ",".join(map(str, spec.concurrencies))],
        **spec.extra_config,
    }
    env = {
        "host": "synthetic-fixture",
        "gpus": [{"index": i, "name": _text(spec, spec.gpu_name), "power_limit_w": 600.0, "sm_clock_max_mhz": 2430}
                 for i in range(spec.gpus)],
        "clock_anchor": {"monotonic_ns": T0_NS, "unix_ns": 1_760_000_000_000_000_000},
    }
    run = RunDir.create(path, config, env)

    t = T0_NS
    windows: list[tuple[int, int, int]] = []  # (start, measure_start, end) per point
    request_id = 0
    stalls: dict[int, list[int]] = {}
    with run.jsonl_writer(rundir.REQUESTS) as req_w, run.jsonl_writer(rundir.POINTS) as pt_w:
        for idx, (conc, tok_s) in enumerate(zip(spec.concurrencies, spec.tok_s, strict=True)):
            start = t
            # warm-up: a few short requests before the measured window
            for _ in range(spec.warmup):
                req_w.write(RequestRecord(request_id, idx, "warmup", t, t, t + 200_000_000, t + 50_000_000,
                                          (t + 50_000_000,), (1,), spec.prompt_len, 1, "usage", 1))
                request_id += 1
            t += 300_000_000
            measure_start = t
            sims, duration_units = _simulate_point(spec, idx, conc, rng)
            ok_tokens = sum(spec.output_len for sim in sims if not sim["fail"])
            # Scale so the point delivers tok_s exactly by load.metrics' formula: tokens over first
            # send to last end, the end being 1 ms after the last chunk.
            unit_ns = (ok_tokens / tok_s * 1e9 - END_AFTER_LAST_CHUNK_NS) / duration_units

            def ns(units: float, unit_ns: float = unit_ns, base: int = measure_start) -> int:
                return base + int(units * unit_ns)

            end = measure_start
            n_requests = len(sims)
            for sim in sims:
                if sim["fail"]:
                    rec = RequestRecord(
                        request_id=request_id, point=idx, phase="measure", scheduled_ns=ns(sim["send"]),
                        send_ns=ns(sim["send"]), end_ns=ns(sim["first"]), prompt_tokens=spec.prompt_len, ok=False,
                        error_kind="http_status", http_status=503,
                        error_text=_text(spec, "HTTP 503: server overloaded"),
                    )
                else:
                    chunks = tuple(ns(x) for x in sim["chunks"])
                    rec = RequestRecord(
                        request_id=request_id, point=idx, phase="measure", scheduled_ns=ns(sim["send"]),
                        send_ns=ns(sim["send"]), end_ns=chunks[-1] + END_AFTER_LAST_CHUNK_NS, first_token_ns=chunks[0],
                        chunk_ns=chunks, chunk_tokens=tuple(sim["tokens"]), prompt_tokens=spec.prompt_len,
                        output_tokens=spec.output_len, output_tokens_source="usage",
                        requested_output_tokens=spec.output_len, finish_reason="length",
                    )
                    stalls.setdefault(idx, []).extend(ns(x) for x in sim["stalls"])
                req_w.write(rec)
                request_id += 1
                end = max(end, rec.end_ns)
            pt_w.write(PointRecord(idx, f"c={conc}", conc, None, start, measure_start, end, n_requests, spec.warmup,
                                   client={"loop_lag_p99_ms": 0.4, "cpu_pct": 35.0}))
            windows.append((start, measure_start, end))
            t = end + 2_000_000_000  # idle gap between points

    if spec.with_summary:
        metrics.summarize_run(run)
    if spec.with_telemetry:
        _write_telemetry(run, spec, windows, rng)
    if spec.with_roofline:
        _write_roofline(run, spec)
    if spec.diagnosis == "synthetic":
        _write_diagnosis(run, spec, stalls)
    elif spec.diagnosis == "real":
        diagnose.write_diagnosis(RunDir.open(path))
    return RunDir.open(path)


def _simulate_point(spec: RunSpec, idx: int, conc: int, rng: random.Random) -> tuple[list[dict], float]:
    """One closed-loop point in units of the per-token interval; returns request timelines and the duration."""
    running = min(conc, spec.running_cap)
    slots = [0.0] * running
    sims = []
    n_fail = spec.failures if idx == len(spec.concurrencies) - 1 else 0
    for k in range(conc * spec.requests_per_slot):
        s = min(range(running), key=slots.__getitem__)
        send = rng.random() * 0.05 if k < conc else slots[s]
        begin = max(send, slots[s])
        first = begin + 1.5 + rng.random()  # prefill: one or two decode steps
        if k < n_fail:
            sims.append({"send": send, "first": first, "fail": True})
            slots[s] = first
            continue
        chunks, tokens, stall_at = [first], [1], []
        cur, remaining = first, spec.output_len - 1
        while remaining > 0:
            n = min(spec.chunk_tokens, remaining)
            g = n * (0.85 + 0.3 * rng.random())
            if rng.random() < spec.stall_prob:
                g += 12 + 10 * rng.random()  # a stall: 12-22 token intervals without output
                stall_at.append(cur + g)
            cur += g
            chunks.append(cur)
            tokens.append(n)
            remaining -= n
        sims.append({"send": send, "chunks": chunks, "tokens": tokens, "stalls": stall_at, "fail": False})
        slots[s] = cur
    t0 = min(sim["send"] for sim in sims)
    for sim in sims:  # the first send is the point's time zero
        sim["send"] -= t0
        sim["first"] = sim.get("first", 0.0) - t0
        sim["chunks"] = [c - t0 for c in sim.get("chunks", [])]
        sim["stalls"] = [c - t0 for c in sim.get("stalls", [])]
    duration = max(max(sim["chunks"], default=sim["first"]) for sim in sims)
    return sims, duration


def _in_window(t: int, windows: list[tuple[int, int, int]]) -> int | None:
    for i, (_s, m, e) in enumerate(windows):
        if m <= t <= e:
            return i
    return None


def _write_telemetry(run: RunDir, spec: RunSpec, windows: list[tuple[int, int, int]], rng: random.Random) -> None:
    """Raw samples as the sampler and the scraper write them, then the real ``telemetry.timeline.summarize``."""
    header = list(GPU_COLUMNS)
    path = run.file(rundir.GPU_SAMPLES)
    path.parent.mkdir(parents=True, exist_ok=True)
    t_end = windows[-1][2] + 1_000_000_000
    step = int(spec.sample_interval_s * 1e9)
    energy = [1.0e6] * spec.gpus
    gap_t = windows[min(1, len(windows) - 1)][1] + 5 * step
    gap_written = False
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        t = T0_NS
        while t <= t_end:
            p = _in_window(t, windows)
            load = 0.0 if p is None else min(1.0, 0.6 + 0.15 * p)
            for g in range(spec.gpus):
                power = 78 + load * (150 + 8 * g) + rng.gauss(0, 4)
                energy[g] += power * spec.sample_interval_s
                tensor = load * (4.5 + 1.5 * rng.random())
                values = {
                    "t_ns": t, "gpu": g, "power_w": round(power, 2),
                    "power_instant_w": round(power + rng.gauss(0, 10), 2),
                    "energy_j": round(energy[g], 1), "power_limit_w": 600.0,
                    "sm_clock_mhz": 2407 + rng.choice((0, 8, -75)) if load else 180, "sm_clock_max_mhz": 2430,
                    "mem_clock_mhz": 14001, "mem_clock_max_mhz": 14001, "gpu_util_pct": 100.0 if load else 0.0,
                    "mem_util_pct": round(load * 40, 1), "temp_c": 55 + 15 * load, "mem_used_bytes": 90e9,
                    "pcie_tx_bytes_s": 1.0e8, "pcie_rx_bytes_s": 1.0e8, "gpm_sm_active_pct": round(load * 85, 1),
                    "gpm_sm_occupancy_pct": round(load * 40, 1), "gpm_tensor_active_pct": round(tensor, 2),
                    "gpm_dram_bw_pct": round(load * (30 + 6 * rng.random()), 1),
                    "gpm_fp16_active_pct": round(tensor * 0.2, 2), "gpm_fp32_active_pct": round(load * 12, 1),
                    "gpm_fp64_active_pct": 0.0, "gpm_hmma_active_pct": round(tensor, 2), "gpm_imma_active_pct": 0.0,
                }
                if g == spec.gpus - 1 and t >= gap_t and not gap_written:  # one recorded gap: a failed read
                    values = {"t_ns": t, "gpu": g, "error": _text(spec, "NVML_ERROR_GPU_IS_LOST")}
                    gap_written, gap_t = True, t
                w.writerow(["" if values.get(c) is None else values[c] for c in header])
            t += step
    with run.file(rundir.SERVER_SAMPLES).open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["t_ns", "source", "metric", "labels", "value"])
        t = T0_NS
        while t <= t_end:
            p = _in_window(t, windows)
            conc = spec.concurrencies[p] if p is not None else 0
            running = min(conc, spec.running_cap)
            for metric, value in (("running_requests", running), ("queued_requests", conc - running),
                                  ("kv_cache_usage", 0.6 * running / spec.running_cap)):
                w.writerow([t, "server", metric, json.dumps({"model_name": spec.model_name}), value])
            t += 4 * step
    run.write_json(rundir.TELEMETRY_NOTES, {
        "final": True, "gpu_telemetry": "on (synthetic fixture)",
        "gpus": [{"index": g, "name": _text(spec, spec.gpu_name), "power_limit_w": 600.0,
                  "sm_clock_max_mhz": 2430} for g in range(spec.gpus)],
        "skipped_counters": [{"gpu": g, "counter": "nvlink_tx_bytes_s", "reason": "not supported"}
                             for g in range(spec.gpus)],
        "gaps": [{"gpu": spec.gpus - 1, "t_ns": gap_t, "error": _text(spec, "NVML_ERROR_GPU_IS_LOST")}],
        "server_ceiling": {"max_running_requests": spec.running_cap, "source": "synthetic fixture"},
    })
    timeline.summarize(run)


def _write_roofline(run: RunDir, spec: RunSpec) -> None:
    """The real analytical model (``servescope.roofline``), written as ``servescope run`` writes it."""
    context = spec.prompt_len + spec.output_len // 2
    points = roofline.decode_sweep("glm-5", "rtx-pro-6000-server", dtype="nvfp4", tp=8, ep=1,
                                   concurrencies=list(spec.concurrencies), context_len=context)
    run.write_json(rundir.ROOFLINE, {"model": _text(spec, "glm-5"), "gpu": "rtx-pro-6000-server", "dtype": "nvfp4",
                                     "tp": 8, "ep": 1, "context_len": context,
                                     "points": [p.to_dict() for p in points]})


TEL = "telemetry_summary.json point 2"


def _write_diagnosis(run: RunDir, spec: RunSpec, stalls_by_point: dict[int, list[int]]) -> None:
    knee = spec.concurrencies.index(spec.running_cap) if spec.running_cap in spec.concurrencies else 0
    at_knee = sorted(stalls_by_point.get(knee, []))
    stalls = at_knee[:: max(1, len(at_knee) // 12)][:12]
    findings = [
        {"id": "scheduler_ceiling", "title": f"Scheduler / KV ceiling of ~{spec.running_cap} running requests",
         "severity": "critical", "confidence": "high",
         "verdict": _text(spec, f"From c={spec.concurrencies[-1]} on, the server runs at most ~{spec.running_cap} "
                                "requests at once and queues the rest."),
         "evidence": [{"label": "server running (max)", "value": spec.running_cap, "unit": "requests",
                       "source": "telemetry_summary.json server.running_max"},
                      {"label": _text(spec, "KV cache usage (max)"), "value": 62.0, "unit": "%",
                       "source": "telemetry_summary.json server.kv_usage_max"}],
         "points": [len(spec.concurrencies) - 1],
         "recommendations": [_text(spec, "KV cache has headroom (62% used): raise --max-running-requests.")],
         "marks": []},
        {"id": "kernel_efficiency_floor", "title": "Kernel-efficiency floor: busy GPUs doing little tensor work",
         "severity": "critical", "confidence": "high",
         "verdict": "At c=1024 the GPUs report 100% utilisation at full clocks yet draw only 39% of their power "
                    "limit and keep the tensor pipes 5% busy.",
         "evidence": [{"label": "GPU utilisation (NVML, mean)", "value": 100.0, "unit": "%", "source": TEL},
                      {"label": "power as % of limit", "value": 39.2, "unit": "%", "source": TEL},
                      {"label": "tokens per expert (roofline, mean)", "value": 32, "unit": "tokens",
                       "source": "roofline.json c=1024"}],
         "points": [knee], "recommendations": ["Expert parallelism instead of TP for the MoE layers."], "marks": []},
        {"id": "plateau", "title": f"Throughput plateaus at c={spec.concurrencies[knee]}", "severity": "warning",
         "confidence": "high", "verdict": "More concurrency buys under 15% per doubling.",
         "evidence": [{"label": "gain per doubling c=1024->2048", "value": 2.4, "unit": "%", "source": "summary"}],
         "points": [knee], "recommendations": [], "marks": []},
        {"id": "tail_latency", "title": "Heavy ITL tail", "severity": "warning", "confidence": "medium",
         "verdict": "ITL p99 is far above the median.", "evidence": [], "points": [knee],
         "recommendations": ["Chunked prefill keeps decodes running."],
         "marks": [{"t_ns": t, "label": _text(spec, "stall")} for t in stalls]},
    ]
    run.write_json(rundir.DIAGNOSIS, {"headline": _text(spec, f"Throughput plateaus at c={spec.concurrencies[knee]}; "
                                                              "scheduler ceiling; kernel-efficiency floor."),
                                      "findings": findings, "notes": [_text(spec, "synthetic fixture")]})
