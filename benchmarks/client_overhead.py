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
row offers far more chunks than any client can read (cadence 1 ms, 16 events per write, 512
tokens per request so the run lasts about a second: CPU is read in 10 ms ticks); on a 2-core
machine the server shares the box, so a client faster than the server reads as the server's rate.

Clients: ``servescope`` (one process), ``servescope-w2`` (``--workers 2``, both workers on the
one client CPU), ``servescope-w2-allcpus`` (``--workers 2`` allowed on CPUs 0 and 1, i.e. sharing
the server's core: on 2 cores the only way for a second process to get a core), ``sglang``,
``vllm``. Client CPU counts the client's child processes too (/proc/PID/stat of each).
``--repeat N`` runs every client N times per level, interleaved with the client order rotated;
the table shows the median of the N runs and the range of the p99.

    .venv/bin/python benchmarks/client_overhead.py --repeat 3 --out docs/measurements/client-overhead.json
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


def _pin(cpus: set[int] | None):
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, cpus)


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name; index 1 is the parent pid, 11/12 utime/stime, 13/14 cutime/cstime."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _children(pid: int) -> list[int]:
    """Live child processes of ``pid`` (servescope --workers N starts N workers and a resource tracker)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if int(_stat_fields(int(d))[1]) == pid:
                    out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _run_sampled(cmd: list[str], cpus: set[int] | None, expect_children: int = 0,
                 **kw: Any) -> list[tuple[int, dict[int, int]]]:
    """Run ``cmd``; every 20 ms record (CLOCK_MONOTONIC ns, {pid: CPU ticks}) for it and its child processes.

    The command's own entry is utime + stime + cutime + cstime (children it reaped); each live
    child's is its utime + stime. Children are looked for on every sample until
    ``expect_children`` are seen (servescope --workers 2: two workers and multiprocessing's
    resource tracker), then every second: a scan of /proc costs a few ms.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=_pin(cpus), **kw)
    samples: list[tuple[int, dict[int, int]]] = []
    kids: list[int] = []
    listed = 0.0
    while proc.poll() is None:
        try:
            if len(kids) < expect_children or time.monotonic() - listed > 1.0:
                kids = _children(proc.pid)
                listed = time.monotonic()
            f = _stat_fields(proc.pid)
            ticks = {proc.pid: sum(int(f[i]) for i in (11, 12, 13, 14))}
            for k in kids:
                try:
                    kf = _stat_fields(k)
                    ticks[k] = int(kf[11]) + int(kf[12])
                except (OSError, IndexError, ValueError):
                    pass
            samples.append((time.monotonic_ns(), ticks))
        except (OSError, IndexError, ValueError):
            pass
        time.sleep(0.02)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd[:3], stderr=err[-500:])
    return samples


def _cpu_during(samples: list[tuple[int, dict[int, int]]], t0: int, t1: int) -> float | None:
    """Cores the client used between t0 and t1 (its first and last chunk arrival), all its processes together.

    Per process: ticks at the last sample in the window minus ticks at its first sample in the
    window, so a child first seen mid-window does not bring its start-up CPU into the window.
    """
    inside = [(t, c) for t, c in samples if t0 <= t <= t1]
    if len(inside) < 2 or inside[-1][0] == inside[0][0]:
        return None
    first: dict[int, int] = {}
    for _, c in inside:
        for pid, ticks in c.items():
            first.setdefault(pid, ticks)
    used = sum(ticks - first[pid] for pid, ticks in inside[-1][1].items())
    return used * _TICK_S / ((inside[-1][0] - inside[0][0]) / 1e9)


def _stats(url: str, reset: bool = False) -> dict[str, Any]:
    req = urllib.request.Request(url + ("/stats/reset" if reset else "/stats"), data=b"" if reset else None,
                                 method="POST" if reset else "GET")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _summ(pairs: list[tuple[int, int]], ok: int, failed: int, wall_s: float,
          samples: list[tuple[int, dict[int, int]]] | None = None) -> dict[str, Any]:
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


def _ceiling(pairs: list[tuple[int, int]], samples: list[tuple[int, dict[int, int]]] | None) -> dict[str, Any]:
    """Client CPU while chunks flowed, and the events/s one full core would sustain at that cost."""
    if not pairs or not samples:
        return {"client_cpu_frac": None, "events_per_cpu_s": None}
    arr = sorted(a for a, _ in pairs)
    frac = _cpu_during(samples, arr[0], arr[-1])
    span = (arr[-1] - arr[0]) / 1e9
    eps = len(arr) / span if span else None
    return {"client_cpu_frac": frac, "events_per_cpu_s": eps / frac if (eps and frac) else None}


def run_servescope(url: str, streams: int, out_len: int, cpus: set[int] | None, tmp: Path,
                   workers: int = 1) -> dict[str, Any]:
    run = tmp / f"ss-{streams}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "servescope", "bench", "--url", url, "--model", MODEL, "--concurrency", str(streams),
           "--dataset", "text:x", "--output-len", str(out_len), "--num-prompts", str(streams), "--out", str(run),
           "--warmup", "0", "--workers", str(workers),
           "--timeout-s", "120"]
    t0 = time.time()
    samples = _run_sampled(cmd, cpus, expect_children=workers + 1 if workers > 1 else 0)
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


def run_vllm(url: str, streams: int, out_len: int, cpu: set[int] | None, tmp: Path,
             tokenizer: Path) -> dict[str, Any]:
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


def run_sglang(url: str, streams: int, out_len: int, cpu: set[int] | None, tmp: Path,
               tokenizer: Path) -> dict[str, Any]:
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


#: Clients the script knows. "servescope-w2" is ``--workers 2`` on the same one client CPU as the others;
#: "servescope-w2-allcpus" lets its two workers use the server's CPU as well (on a 2-core machine the only
#: way for a second client process to get a core of its own).
CLIENTS = ("servescope", "servescope-w2", "servescope-w2-allcpus", "sglang", "vllm")
_NUMERIC = ("events_per_s", "p50_ms", "p99_ms", "p99_mid_ms", "max_ms", "server_lateness_p99_ms", "client_cpu_frac",
            "events_per_cpu_s")


def _loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (level, client): the median over repetitions of every figure, plus the p99 range."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        key = (r["streams"], r["cadence_ms"], r.get("ceiling"), r.get("burst", 1), r["client"])
        groups.setdefault(key, []).append(r)
    out = []
    for rs in groups.values():
        good = [r for r in rs if "error" not in r]
        agg: dict[str, Any] = {k: rs[0][k] for k in ("streams", "cadence_ms", "ceiling", "burst", "client",
                                                      "offered_events_per_s") if k in rs[0]}
        agg["reps"] = len(rs)
        agg["errors"] = [r["error"] for r in rs if "error" in r]
        if good:
            agg["ok"] = sum(r["ok"] for r in good)
            agg["failed"] = sum(r["failed"] for r in good)
            for k in _NUMERIC:
                vals = [r[k] for r in good if r.get(k) is not None]
                agg[k] = statistics.median(vals) if vals else None
            p99s = [r["p99_ms"] for r in good if r.get("p99_ms") is not None]
            agg["p99_min_ms"], agg["p99_max_ms"] = (min(p99s), max(p99s)) if p99s else (None, None)
        out.append(agg)
    return out


def render(data: dict[str, Any]) -> str:
    """The Markdown table of a results file: per level and client, the median of the repetitions."""

    def f(v: Any, nd: int = 2) -> str:
        return "-" if v is None else (f"{v:,.{nd}f}" if isinstance(v, float) else str(v))

    out = ["| streams | cadence ms | offered ev/s | client | reps | ok/failed | events/s | added p50 ms | "
           "added p99 ms (range) | p99 mid-run ms | max ms | server lateness p99 ms | client CPU (cores) | "
           "events per client CPU-s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in aggregate(data["rows"]):
        label = f"{r['streams']}" + (f" (ceiling, {r.get('burst', 1)} events/write)" if r.get("ceiling") else "")
        head = (f"| {label} | {f(r['cadence_ms'], 0)} | {f(r['offered_events_per_s'], 0)} | {r['client']} | "
                f"{r['reps']} |")
        if "ok" not in r:
            out.append(f"{head} error: {r['errors'][0][:80]} | | | | | | | | |")
            continue
        rng = f" ({f(r['p99_min_ms'])}-{f(r['p99_max_ms'])})" if r["reps"] > 1 else ""
        err = f" ({len(r['errors'])} runs failed)" if r["errors"] else ""
        out.append(f"{head} {r['ok']}/{r['failed']}{err} | {f(r['events_per_s'], 0)} | {f(r['p50_ms'])} | "
                   f"{f(r['p99_ms'])}{rng} | {f(r.get('p99_mid_ms'))} | {f(r['max_ms'])} | "
                   f"{f(r.get('server_lateness_p99_ms'))} | {f(r.get('client_cpu_frac'))} | "
                   f"{f(r.get('events_per_cpu_s'), 0)} |")
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
    ap.add_argument("--ceiling-output-len", type=int, default=512,
                    help="tokens per request in the ceiling row: long enough (~1 s of events) for CPU ticks of 10 ms")
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each client at each level, interleaved (client order rotates each repetition)")
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
    unknown = set(clients) - set(CLIENTS)
    if unknown:
        ap.error(f"unknown clients {sorted(unknown)}; choose from {','.join(CLIENTS)}")
    one_cpu = {a.client_cpu}
    rows = []
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_start = _loadavg()
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="client-overhead-") as tmpd:
        tmp = Path(tmpd)
        for lv in levels:
            streams, cadence_ms = int(lv[0]), lv[1]
            ceiling = len(lv) > 2
            burst = int(lv[2]) if ceiling else 1
            out_len = a.ceiling_output_len if ceiling else a.output_len
            cfg = SelftestServerConfig(tokens_per_s=burst * 1000.0 / cadence_ms, tokens_per_chunk=1, ttft_ms=5.0,
                                       model=MODEL, burst=burst)
            with spawn(cfg, cpu=a.server_cpu) as url:
                for rep in range(a.repeat):
                    order = clients[rep % len(clients):] + clients[:rep % len(clients)]
                    for client in order:
                        _stats(url, reset=True)
                        load = _loadavg()
                        try:
                            if client == "servescope":
                                res = run_servescope(url, streams, out_len, one_cpu, tmp)
                            elif client == "servescope-w2":
                                res = run_servescope(url, streams, out_len, one_cpu, tmp, workers=2)
                            elif client == "servescope-w2-allcpus":
                                res = run_servescope(url, streams, out_len, one_cpu | {a.server_cpu}, tmp,
                                                     workers=2)
                            elif client == "sglang":
                                res = run_sglang(url, streams, out_len, one_cpu, tmp, tokenizer)
                            else:
                                res = run_vllm(url, streams, out_len, one_cpu, tmp, tokenizer)
                        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError, KeyError) as err:
                            res = {"error": str(err)[:300]}
                        st = _stats(url)
                        res.update(client=client, rep=rep, streams=streams, output_len=out_len, cadence_ms=cadence_ms,
                                   ceiling=ceiling,
                                   burst=burst, offered_events_per_s=streams * burst * 1000.0 / cadence_ms,
                                   server_lateness_p99_ms=st.get("lateness_p99_ms"),
                                   server_chunks_sent=st.get("chunks_sent"), loadavg_1m_before=load[0])
                        rows.append(res)
                        print(json.dumps(res), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"date": started, "date_end": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                                 "wall_s": time.monotonic() - t_start, "argv": sys.argv,
                                 "loadavg_start": load_start, "loadavg_end": _loadavg(),
                                 "cpus": os.cpu_count(), "uname": " ".join(os.uname()), "rows": rows,
                                 "summary": aggregate(rows)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
