"""Measure the embedded engine's costs: tiny-model build (cold and cached), server startup, and stop.

Usage: ``python benchmarks/engine_startup.py [--repeats 3] [--vllm-python PATH]``. Prints a Markdown block (date,
machine, command, a table) that docs/engine.md quotes. Each cold build uses a fresh temporary cache; each startup is
``start_engine`` until healthy and warmed up (one 1-token request); stop is SIGTERM until the port is free.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from servescope.engine.launcher import EngineConfig, start_engine
from servescope.engine.tiny_model import TinyMoeSpec, build_tiny_moe


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _fmt(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f}, n={len(values)})"


def _stream_once(base_url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, float, int, int]:
    """One streamed completion: (TTFT s, end-to-end s, prompt tokens, completion tokens) from the server's usage."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}).encode()
    request = urllib.request.Request(
        f"{base_url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    first = None
    usage: dict = {}
    with urllib.request.urlopen(request, timeout=300) as reply:
        for line in reply:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            first = first if first is not None else time.perf_counter() - started
            usage = json.loads(line[5:]).get("usage") or usage
    return first or 0.0, time.perf_counter() - started, usage["prompt_tokens"], usage["completion_tokens"]


def _ceiling_demo(
    model_dir: Path, root: Path, num_blocks: str, streams: int
) -> tuple[list[tuple[float, float, int, int]], float]:
    """``streams`` concurrent 128-token completions against transformers serve with ``--cb-num-blocks num_blocks``."""
    cfg = EngineConfig(model_dir=model_dir, log_path=root / f"ceiling{num_blocks}.log",
                       extra_args=("--cb-num-blocks", num_blocks))  # fmt: skip
    with start_engine(cfg) as handle, ThreadPoolExecutor(max_workers=streams) as pool:
        prompt = "word " * 100
        started = time.perf_counter()
        jobs = [pool.submit(_stream_once, handle.base_url, handle.served_model, prompt, 128) for _ in range(streams)]
        results = [job.result() for job in jobs]
        return results, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm-python", default=None, help="interpreter with vllm installed; omit to skip vLLM")
    args = parser.parse_args()

    rows: list[tuple[str, list[float]]] = []
    with tempfile.TemporaryDirectory(prefix="servescope-bench-") as tmp:
        root = Path(tmp)
        fresh, warm = [], []
        for i in range(args.repeats):
            # What a first `servescope run` pays: a new process that imports torch + transformers, then builds.
            cache = str(root / f"fresh{i}")
            code = f"from servescope.engine.tiny_model import build_tiny_moe; build_tiny_moe(cache_dir={cache!r})"
            started = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
            fresh.append(time.perf_counter() - started)
        for i in range(args.repeats + 1):
            started = time.perf_counter()
            model_dir = build_tiny_moe(TinyMoeSpec(), cache_dir=root / f"cold{i}")
            if i > 0:  # the first pays the imports, measured above
                warm.append(time.perf_counter() - started)
        rows.append(("tiny model build, cold, in a new process incl. imports (s)", fresh))
        rows.append(("tiny model build, cold, libraries already imported (s)", warm))
        started = time.perf_counter()
        build_tiny_moe(TinyMoeSpec(), cache_dir=root / "cold0")
        rows.append(("tiny model build, cache hit (s)", [time.perf_counter() - started]))
        size_mb = sum(p.stat().st_size for p in model_dir.iterdir()) / 1e6
        rows.append(("tiny model folder size (MB)", [size_mb]))

        engines = [("transformers", sys.executable, args.repeats)]
        if args.vllm_python:
            engines.append(("vllm", args.vllm_python, 1))
        for kind, python, repeats in engines:
            startups, stops = [], []
            for i in range(repeats):
                cfg = EngineConfig(kind=kind, model_dir=model_dir, python=python, log_path=root / f"{kind}{i}.log")
                with start_engine(cfg) as handle:
                    startups.append(handle.startup_s)
                    stop_started = time.perf_counter()
                stops.append(time.perf_counter() - stop_started)
            rows.append((f"{kind} serve: start to healthy + warm-up (s)", startups))
            rows.append((f"{kind} serve: stop until port free (s)", stops))

        ceiling_rows = []
        for num_blocks in ("512", "16"):
            results, wall_s = _ceiling_demo(model_dir, root, num_blocks, 8)
            ttfts = sorted(r[0] for r in results)
            ceiling_rows.append((num_blocks, results[0][2], {r[3] for r in results}, ttfts, wall_s))

    date = subprocess.run(["date"], capture_output=True, text=True).stdout.strip()
    print(f"- date: {date}")
    print(f"- machine: {platform.node()}, {_cpu_model()}, {os.cpu_count()} CPUs, {platform.platform()}")
    print(f"- python {platform.python_version()}; command: `python {' '.join(sys.argv)}`")
    print()
    print("| what | value: median (min, max, n) |")
    print("|---|---|")
    for name, values in rows:
        print(f"| {name} | {_fmt(values)} |")
    print()
    print("KV ceiling on purpose: 8 concurrent streamed completions (prompt 'word ' x 100, max_tokens 128) against")
    print("transformers serve with `--cb-num-blocks N` (blocks of 32 tokens; start-up not included in the times):")
    print()
    print("| --cb-num-blocks | prompt tokens | completion tokens | TTFT min / median / max (s) | all 8 done (s) |")
    print("|---|---|---|---|---|")
    for num_blocks, prompt_tokens, completions, ttfts, _wall_s in ceiling_rows:
        spread = f"{ttfts[0]:.2f} / {statistics.median(ttfts):.2f} / {ttfts[-1]:.2f}"
        print(f"| {num_blocks} | {prompt_tokens} | {sorted(completions)} | {spread} | {_wall_s:.2f} |")


if __name__ == "__main__":
    main()
