"""Client-added delay and chunk-event ceiling: servescope vs sglang's bench_serving vs vLLM's bench serve.

Every client drives the same stamped selftest server (servescope.load.selftest_server): each
chunk carries its send time on CLOCK_MONOTONIC, in JSON (read by servescope) and in the text
(`` t<ns>``, kept by the peers in their generated text). Each client stamps arrivals on the
same clock (servescope: ``time.monotonic_ns``; sglang and vLLM: ``time.perf_counter``, which is
CLOCK_MONOTONIC on Linux), so per chunk ``added delay = arrival - send stamp``. For the peers,
arrival of chunk i is ``start_time + ttft + sum(itl[:i])`` from their own saved records (vLLM
``--save-detailed``; sglang through benchmarks/peer_sglang.py, which keeps ``start_time``).

Levels are closed loop, one request per stream, request rate unlimited (the seed's mode); the
server runs pinned to CPU 0 and each client to CPU 1 (taskset-style affinity), one client at a
time. "events/s" is chunks received / (last arrival - first arrival) over the run. The ceiling
row offers far more chunks than any client can read (cadence 1 ms); on a 2-core machine the
server shares the box, so a client faster than the server reads as the server's rate.

    .venv/bin/python benchmarks/client_overhead.py --out docs/measurements/client-overhead.json
    .venv/bin/python benchmarks/client_overhead.py --render docs/measurements/client-overhead.json  # the table
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from servescope.load.selftest_server import SelftestServerConfig, spawn

VLLM_PY = Path("/work/peers/vllm/bin/python")
SGLANG_PY = Path("/work/peers/sglang/bin/python")
HERE = Path(__file__).resolve().parent
MODEL = "servescope-selftest"
_STAMP = re.compile(r" t(\d+)")


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def _pin(cpu: int | None):
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _run_sampled(cmd: list[str], cpu: int | None, **kw: Any) -> list[tuple[int, float]]:
    """Run ``cmd``; every 20 ms record (CLOCK_MONOTONIC ns, the process's CPU seconds from /proc/PID/stat)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=_pin(cpu), **kw)
    samples: list[tuple[int, float]] = []
    stat = Path(f"/proc/{proc.pid}/stat")
    while proc.poll() is None:
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            samples.append((time.monotonic_ns(), (int(fields[11]) + int(fields[12])) * _TICK_S))
        except (OSError, IndexError, ValueError):
            pass
        time.sleep(0.02)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd[:3], stderr=err[-500:])
    return samples


def _cpu_during(samples: list[tuple[int, float]], t0: int, t1: int) -> float | None:
    """Fraction of one core the client used between t0 and t1 (its first and last chunk arrival)."""
    inside = [(t, c) for t, c in samples if t0 <= t <= t1]
    if len(inside) < 2 or inside[-1][0] == inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) / ((inside[-1][0] - inside[0][0]) / 1e9)


def _stats(url: str, reset: bool = False) -> dict[str, Any]:
    req = urllib.request.Request(url + ("/stats/reset" if reset else "/stats"), data=b"" if reset else None,
                                 method="POST" if reset else "GET")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _summ(pairs: list[tuple[int, int]], ok: int, failed: int, wall_s: float,
          samples: list[tuple[int, float]] | None = None) -> dict[str, Any]:
    """pairs: (arrival_ns, stamp_ns) per chunk."""
    delays = [(a - s) / 1e6 for a, s in pairs]
    arr = [a for a, _ in pairs]
    span = (max(arr) - min(arr)) / 1e9 if len(arr) > 1 else 0.0
    # The same figure without the first and last 10 % of the run (by send stamp): shows how much of the
    # tail comes from the start (connection storm) and the drain (all streams ending together).
    stamps = [s for _, s in pairs]
    lo = min(stamps, default=0) + 0.1 * (max(stamps, default=0) - min(stamps, default=0))
    hi = max(stamps, default=0) - 0.1 * (max(stamps, default=0) - min(stamps, default=0))
    mid = [(a - s) / 1e6 for a, s in pairs if lo <= s <= hi]
    return {"ok": ok, "failed": failed, "chunks": len(pairs), "events_per_s": len(pairs) / span if span else None,
            "p50_ms": _pct(delays, 50), "p99_ms": _pct(delays, 99), "max_ms": max(delays) if delays else None,
            "p99_mid_ms": _pct(mid, 99),
            "mean_ms": statistics.fmean(delays) if delays else None, "wall_s": wall_s,
            **_ceiling(pairs, samples)}


def _ceiling(pairs: list[tuple[int, int]], samples: list[tuple[int, float]] | None) -> dict[str, Any]:
    """Client CPU while chunks flowed, and the events/s one full core would sustain at that cost."""
    if not pairs or not samples:
        return {"client_cpu_frac": None, "events_per_cpu_s": None}
    arr = sorted(a for a, _ in pairs)
    frac = _cpu_during(samples, arr[0], arr[-1])
    span = (arr[-1] - arr[0]) / 1e9
    eps = len(arr) / span if span else None
    return {"client_cpu_frac": frac, "events_per_cpu_s": eps / frac if (eps and frac) else None}


def run_servescope(url: str, streams: int, out_len: int, cpu: int | None, tmp: Path) -> dict[str, Any]:
    run = tmp / f"ss-{streams}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "servescope", "bench", "--url", url, "--model", MODEL, "--concurrency", str(streams),
           "--dataset", "text:x", "--output-len", str(out_len), "--num-prompts", str(streams), "--out", str(run),
           "--warmup", "0",
           "--timeout-s", "120"]
    t0 = time.time()
    samples = _run_sampled(cmd, cpu)
    wall = time.time() - t0
    pairs: list[tuple[int, int]] = []
    ok = failed = 0
    for line in (run / "requests.jsonl").read_text().splitlines():
        r = json.loads(line)  # warm-up requests too: the peers' figures include all their requests
        ok += r["ok"]
        failed += not r["ok"]
        pairs += list(zip(r["chunk_ns"], r["chunk_send_ns"], strict=False))
    return _summ(pairs, ok, failed, wall, samples)


def _peer_pairs(records: list[dict[str, Any]]) -> tuple[list[tuple[int, int]], int, int]:
    pairs: list[tuple[int, int]] = []
    ok = failed = 0
    for r in records:
        if not r["success"]:
            failed += 1
            continue
        ok += 1
        stamps = [int(s) for s in _STAMP.findall(r["generated_text"])]
        t = r["start_time"] + r["ttft"]
        arrivals = [t]
        for gap in r["itl"]:
            t += gap
            arrivals.append(t)
        pairs += [(round(a * 1e9), s) for a, s in zip(arrivals, stamps, strict=False)]
    return pairs, ok, failed


def run_vllm(url: str, streams: int, out_len: int, cpu: int | None, tmp: Path, tokenizer: Path) -> dict[str, Any]:
    rdir = tmp / f"vllm-{streams}-{time.monotonic_ns()}"
    rdir.mkdir()
    cmd = [str(VLLM_PY), str(HERE / "peer_vllm.py"), "--backend", "openai", "--base-url", url,
           "--model", MODEL, "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", "16",
           "--random-output-len", str(out_len), "--num-prompts", str(streams), "--max-concurrency", str(streams),
           "--request-rate", "inf", "--ignore-eos", "--save-result", "--save-detailed", "--result-dir", str(rdir),
           "--result-filename", "r.json", "--disable-tqdm"]
    t0 = time.time()
    samples = _run_sampled(cmd, cpu, cwd=rdir, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.time() - t0
    d = json.loads((rdir / "r.json").read_text())
    n = len(d["start_times"])
    recs = [{"success": bool(d["ttfts"][i]) and not d["errors"][i], "start_time": d["start_times"][i],
             "ttft": d["ttfts"][i], "itl": d["itls"][i], "generated_text": d["generated_texts"][i]} for i in range(n)]
    pairs, ok, failed = _peer_pairs(recs)
    return _summ(pairs, ok, failed, wall, samples)


def run_sglang(url: str, streams: int, out_len: int, cpu: int | None, tmp: Path, tokenizer: Path) -> dict[str, Any]:
    side = tmp / f"sglang-{streams}-{time.monotonic_ns()}.json"
    cmd = [str(SGLANG_PY), str(HERE / "peer_sglang.py"), "--servescope-out", str(side), "--",
           "--backend", "sglang-oai", "--base-url", url, "--model", MODEL, "--tokenizer", str(tokenizer),
           "--dataset-name", "random-ids", "--random-input-len", "16", "--random-output-len", str(out_len),
           "--random-range-ratio", "1.0", "--num-prompts", str(streams), "--max-concurrency", str(streams),
           "--request-rate", "inf", "--output-file", str(tmp / "sglang.jsonl"), "--disable-tqdm"]
    t0 = time.time()
    samples = _run_sampled(cmd, cpu, cwd=tmp, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.time() - t0
    recs = json.loads(side.read_text())[1:]  # the first is sglang's warm-up request
    pairs, ok, failed = _peer_pairs(recs)
    return _summ(pairs, ok, failed, wall, samples)


def render(data: dict[str, Any]) -> str:
    """The Markdown table of a results file (rows as measured; nothing rounded away but display digits)."""

    def f(v: Any, nd: int = 2) -> str:
        return "-" if v is None else (f"{v:,.{nd}f}" if isinstance(v, float) else str(v))

    out = ["| streams | cadence ms | offered ev/s | client | ok/failed | events/s | added p50 ms | added p99 ms | "
           "p99 mid-run ms | max ms | server lateness p99 ms | client CPU (cores) | events per client CPU-s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        label = f"{r['streams']}" + (f" (ceiling, {r.get('burst', 1)} events/write)" if r.get("ceiling") else "")
        if "error" in r:
            out.append(f"| {label} | {f(r['cadence_ms'], 0)} | {f(r['offered_events_per_s'], 0)} | {r['client']} | "
                       f"error: {r['error'][:80]} | | | | | | | | |")
            continue
        out.append(f"| {label} | {f(r['cadence_ms'], 0)} | {f(r['offered_events_per_s'], 0)} | {r['client']} | "
                   f"{r['ok']}/{r['failed']} | {f(r['events_per_s'], 0)} | {f(r['p50_ms'])} | {f(r['p99_ms'])} | "
                   f"{f(r.get('p99_mid_ms'))} | {f(r['max_ms'])} | {f(r.get('server_lateness_p99_ms'))} | "
                   f"{f(r.get('client_cpu_frac'))} | {f(r.get('events_per_cpu_s'), 0)} |")
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--render":
        print(render(json.loads(Path(sys.argv[2]).read_text())))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="64:20,256:20,1024:80,2048:160",
                    help="streams:cadence_ms per level (cadence = ms between one-token chunks of a stream)")
    ap.add_argument("--ceiling", default="256:1:16",
                    help="streams:cadence_ms:burst of the over-offered ceiling row (burst SSE events per write)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--clients", default="servescope,sglang,vllm")
    ap.add_argument("--server-cpu", type=int, default=0)
    ap.add_argument("--client-cpu", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    from servescope.engine.tiny_model import build_tiny_moe

    tokenizer = build_tiny_moe()  # only the peers' random datasets need a tokenizer
    levels = [tuple(float(x) for x in lv.split(":")) for lv in a.levels.split(",") if lv]
    if a.ceiling:
        levels.append((*tuple(float(x) for x in a.ceiling.split(":")), 1.0))
    clients = a.clients.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="client-overhead-") as tmpd:
        tmp = Path(tmpd)
        for lv in levels:
            streams, cadence_ms = int(lv[0]), lv[1]
            ceiling = len(lv) > 2
            burst = int(lv[2]) if ceiling else 1
            cfg = SelftestServerConfig(tokens_per_s=burst * 1000.0 / cadence_ms, tokens_per_chunk=1, ttft_ms=5.0,
                                       model=MODEL, burst=burst)
            with spawn(cfg, cpu=a.server_cpu) as url:
                for client in clients:
                    _stats(url, reset=True)
                    try:
                        if client == "servescope":
                            res = run_servescope(url, streams, a.output_len, a.client_cpu, tmp)
                        elif client == "sglang":
                            res = run_sglang(url, streams, a.output_len, a.client_cpu, tmp, tokenizer)
                        else:
                            res = run_vllm(url, streams, a.output_len, a.client_cpu, tmp, tokenizer)
                    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError, KeyError) as err:
                        res = {"error": str(err)[:300]}
                    st = _stats(url)
                    res.update(client=client, streams=streams, cadence_ms=cadence_ms, ceiling=ceiling, burst=burst,
                               offered_events_per_s=streams * burst * 1000.0 / cadence_ms,
                               server_lateness_p99_ms=st.get("lateness_p99_ms"),
                               server_chunks_sent=st.get("chunks_sent"))
                    rows.append(res)
                    print(json.dumps(res), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv,
                                 "cpus": os.cpu_count(), "uname": " ".join(os.uname()), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
