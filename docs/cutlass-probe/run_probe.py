#!/usr/bin/env python3
"""Build and run the CUTLASS shared-memory probe; write results.json and results.md.

Why this exists: servescope's tile model (``src/servescope/tiles.py``) claims to reproduce the stage count and the
shared-memory bytes that CUTLASS's own collective builders compute. This script asks CUTLASS itself: for every
combination listed in ``combinations()`` it instantiates the real builders (``probe.hpp``), compiles for the real
target with ``nvcc`` (no GPU needed: only host code reads the constexpr/sizeof values) and records what they say.
A combination that CUTLASS rejects at compile time (a ``static_assert``) is recorded as
``"status": "does not compile"`` with the compiler's reason; that is data too.

Combinations are compiled in groups (one translation unit per group, about 16 s of header parsing each on one core).
When a group fails, the failing calls are identified from the compiler's "at line N of <file>" instantiation trail,
recorded, removed, and the group is rebuilt without them.

Usage (see README.md in this directory):
    python docs/cutlass-probe/run_probe.py --include <site-packages>/cutlass_library/source/include [--jobs 2]
Only the Python standard library is used.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARCH_FLAGS = {"sm120": "sm_120a", "sm100": "sm_100a", "sm90": "sm_90a"}
GROUP_SIZE = 24

#: Combinations also compiled as complete kernels (device code for the target), to check that what the host-only
#: pass accepts really builds, and to catch static_asserts that live in the kernel body. About a minute each.
FULL_BUILD = frozenset({
    "sm120-nvfp4xnvfp4-bf16-dense-cooperative-128x128x128",
    "sm120-nvfp4xnvfp4-bf16-grouped-cooperative-128x256x128",
    "sm120-nvfp4xnvfp4-nvfp4-grouped-cooperative-128x128x128",
    "sm120-nvfp4xnvfp4-bf16-dense-pingpong-128x128x128",
    "sm120-mxfp8xmxfp8-bf16-dense-cooperative-128x128x128",
    "sm100-nvfp4xnvfp4-bf16-dense-1sm-128x128x256",
    "sm100-nvfp4xnvfp4-bf16-grouped-2sm-256x256x256",
    "sm90-bf16xbf16-bf16-dense-cooperative-128x128x64",
    "sm90-fp8xfp8-bf16-grouped-pingpong-64x128x128",
    "sm90-bf16xbf16-bf16-dense-cooperative-64x128x64",
})


def _tile(s: str) -> tuple[int, int, int]:
    m, n, k = (int(x) for x in s.split("x"))
    return m, n, k


def combinations() -> list[dict]:
    """Every combination the probe measures (and that tests/test_tiles.py compares servescope against)."""
    out: list[dict] = []

    def add(arch, a, b, epi_out, source, kernel, schedule, tile):
        out.append({"arch": arch, "a": a, "b": b, "out": epi_out, "source": source, "kernel": kernel,
                    "schedule": schedule, "tile": list(_tile(tile))})

    # SM120 block-scaled: the full cross-product of tiles x input formats for the plain bf16 epilogue ...
    sm120_tiles = ["128x128x128", "128x128x256", "128x256x128", "256x128x128", "128x64x128", "128x64x256",
                   "128x32x128", "64x128x128", "128x256x64", "128x128x64", "256x256x128", "128x192x128"]
    sm120_formats = [("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"), ("mxfp8", "mxfp8"), ("mxfp6", "mxfp6"),
                     ("mxfp8", "mxfp4")]
    for a, b in sm120_formats:
        for kernel in ("dense", "grouped"):
            for t in sm120_tiles:
                add("sm120", a, b, "bf16", False, kernel, "cooperative", t)
    # ... every epilogue for NVFP4 inputs on the common tiles ...
    for epi_out, source in (("bf16", True), ("fp16", False), ("fp32", False), ("fp32", True), ("nvfp4", False),
                            ("nvfp4", True)):
        for kernel in ("dense", "grouped"):
            for t in ("128x128x128", "128x256x128", "256x128x128", "128x128x256", "128x64x128"):
                add("sm120", "nvfp4", "nvfp4", epi_out, source, kernel, "cooperative", t)
    for kernel in ("dense", "grouped"):
        for t in ("128x128x128", "128x256x128", "128x128x256"):
            add("sm120", "mxfp8", "mxfp8", "fp32", False, kernel, "cooperative", t)
            add("sm120", "mxfp8", "mxfp8", "nvfp4", False, kernel, "cooperative", t)
    # ... tiles that the stage formula accepts but whose kernel, padding included, asks for more than 101,376 B ...
    for kernel in ("dense", "grouped"):
        add("sm120", "mxfp4", "mxfp4", "bf16", True, kernel, "cooperative", "128x128x128")
        for t in ("128x256x64", "256x128x64"):
            add("sm120", "nvfp4", "nvfp4", "nvfp4", False, kernel, "cooperative", t)
    # ... and the ping-pong schedule.
    for a, b in (("nvfp4", "nvfp4"), ("mxfp8", "mxfp8")):
        for kernel in ("dense", "grouped"):
            for t in ("128x128x128", "128x256x128", "128x64x128", "64x128x128", "128x128x256"):
                add("sm120", a, b, "bf16", False, kernel, "pingpong", t)

    # SM100 block-scaled, 1-SM and 2-SM MMA tiles.
    for a, b in (("nvfp4", "nvfp4"), ("mxfp8", "mxfp8"), ("mxfp4", "mxfp4")):
        for kernel in ("dense", "grouped"):
            for t in ("128x128x256", "128x256x256", "128x64x256", "128x128x128", "128x256x128", "128x192x256"):
                add("sm100", a, b, "bf16", False, kernel, "1sm", t)
            for t in ("256x128x256", "256x256x256", "256x256x128"):
                add("sm100", a, b, "bf16", False, kernel, "2sm", t)
    for kernel in ("dense", "grouped"):
        for epi_out, source in (("nvfp4", False), ("fp32", False), ("bf16", True)):
            for t in ("128x128x256", "128x256x256"):
                add("sm100", "nvfp4", "nvfp4", epi_out, source, kernel, "1sm", t)
            add("sm100", "nvfp4", "nvfp4", epi_out, source, kernel, "2sm", "256x256x256")

    # SM90 plain BF16 / FP8 warp-specialized TMA kernels.
    for a in ("bf16", "fp8"):
        k1, k2 = (64, 128) if a == "bf16" else (128, 256)
        for kernel in ("dense", "grouped"):
            for t in (f"128x128x{k1}", f"128x256x{k1}", f"256x128x{k1}", f"128x128x{k2}", f"128x64x{k1}"):
                add("sm90", a, a, "bf16", False, kernel, "cooperative", t)
            for t in (f"64x128x{k1}", f"64x256x{k1}", f"128x128x{k1}"):
                add("sm90", a, a, "bf16", False, kernel, "pingpong", t)
        for epi_out, source in (("bf16", True), ("fp32", False)):
            for t in (f"128x128x{k1}", f"128x256x{k1}"):
                add("sm90", a, a, epi_out, source, "dense", "cooperative", t)
    # A 64-row cooperative tile: the builders accept it, the kernel body's static_assert does not (full build below).
    add("sm90", "bf16", "bf16", "bf16", False, "dense", "cooperative", "64x128x64")
    for c in out:
        c["id"] = combo_id(c)
        c["full_build"] = c["id"] in FULL_BUILD
    ids = [c["id"] for c in out]
    assert len(ids) == len(set(ids)), "duplicate combination"
    return out


def combo_id(c: dict) -> str:
    m, n, k = c["tile"]
    epi = c["out"] + ("+c" if c["source"] else "")
    return f"{c['arch']}-{c['a']}x{c['b']}-{epi}-{c['kernel']}-{c['schedule']}-{m}x{n}x{k}"


def _epilogue_type(c: dict) -> str:
    src = "true" if c["source"] else "false"
    if c["out"] == "nvfp4":
        return f"probe::Nvfp4Out<{src}>"
    return f"probe::LinComb<probe::{c['out']}, {src}>"


def _call(c: dict) -> str:
    m, n, k = c["tile"]
    grouped = "true" if c["kernel"] == "grouped" else "false"
    flag = "true" if c["schedule"] in ("pingpong", "2sm") else "false"
    return (f"  probe::{c['arch']}<probe::{c['a']}, probe::{c['b']}, {_epilogue_type(c)}, {m}, {n}, {k}, "
            f"{grouped}, {flag}>(\"{c['id']}\");")


def _write_tu(path: Path, combos: list[dict]) -> dict[int, str]:
    """Write a translation unit calling the probe for each combination; return {line number: combination id}."""
    lines = ['#include "probe.hpp"', "int main() {"]
    by_line: dict[int, str] = {}
    for c in combos:
        lines.append(_call(c))
        by_line[len(lines)] = c["id"]
    lines += ["  return 0;", "}", ""]
    path.write_text("\n".join(lines))
    return by_line


_ERROR_RE = re.compile(r"^(?P<file>\S+?)\((?P<line>\d+)\): error: (?P<msg>.*)$")


def _parse_errors(log: str, tu_name: str, include: Path, by_line: dict[int, str]) -> dict[str, str]:
    """Map combination id -> first error reason, using the instantiation trail that ends in the TU."""
    reasons: dict[str, str] = {}
    blocks = re.split(r"\n(?=\S+\(\d+\): error: )", log)
    at_tu = re.compile(r"at line (\d+) of \S*" + re.escape(tu_name))
    for block in blocks:
        first = block.strip().splitlines()[0] if block.strip() else ""
        m = _ERROR_RE.match(first)
        if not m:
            continue
        where = m.group("file")
        try:
            where = str(Path(where).resolve().relative_to(include.resolve()))
        except ValueError:
            where = Path(where).name
        reason = f"{where}:{m.group('line')}: {m.group('msg').strip()}"
        lines = [int(x) for x in at_tu.findall(block)]
        if not lines and Path(m.group("file")).name == tu_name:
            lines = [int(m.group("line"))]  # an error directly on the TU's own line (rare)
        for ln in lines[-1:]:
            cid = by_line.get(ln)
            if cid and cid not in reasons:
                reasons[cid] = reason
    return reasons


def _compile_and_run(nvcc: str, include: Path, arch: str, combos: list[dict], workdir: Path, name: str,
                     log, defines: tuple[str, ...] = ()) -> dict[str, dict]:
    """Compile one group (dropping rejected combinations until the rest compiles); return id -> record."""
    results: dict[str, dict] = {}
    pending = list(combos)
    attempt = 0
    while pending:
        attempt += 1
        tu = workdir / f"{name}_{attempt}.cu"
        exe = workdir / f"{name}_{attempt}"
        by_line = _write_tu(tu, pending)
        cmd = [nvcc, "-std=c++20", "-w", f"-arch={ARCH_FLAGS[arch]}", "--expt-relaxed-constexpr", *defines,
               f"-I{include}", f"-I{HERE}", "-o", str(exe), str(tu)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0:
            run = subprocess.run([str(exe)], capture_output=True, text=True, check=True)
            for line in run.stdout.splitlines():
                rec = json.loads(line)
                rec["status"] = "ok"
                results[rec["id"]] = rec
            log(f"{name}: {len(pending)} combinations compiled (attempt {attempt})")
            return results
        reasons = _parse_errors(proc.stdout + proc.stderr, tu.name, include, by_line)
        if not reasons:
            if len(pending) == 1:
                text = (proc.stdout + proc.stderr).strip().splitlines()
                reasons = {pending[0]["id"]: text[0] if text else "nvcc failed"}
            else:
                half = len(pending) // 2
                log(f"{name}: could not attribute errors, splitting {len(pending)} combinations")
                results.update(_compile_and_run(nvcc, include, arch, pending[:half], workdir, f"{name}a", log,
                                                defines))
                results.update(_compile_and_run(nvcc, include, arch, pending[half:], workdir, f"{name}b", log,
                                                defines))
                return results
        for c in pending:
            if c["id"] in reasons:
                results[c["id"]] = {**c, "status": "does not compile", "reason": reasons[c["id"]]}
        log(f"{name}: {len(reasons)} combinations rejected by CUTLASS, rebuilding the rest")
        pending = [c for c in pending if c["id"] not in reasons]
    return results


def _version(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    except (OSError, IndexError):
        return "unknown"


def _cutlass_version(include: Path) -> str:
    text = (include / "cutlass" / "version.h").read_text()
    parts = [re.search(rf"#define CUTLASS_{p} (\d+)", text).group(1) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(parts)


def _package_info(include: Path) -> dict:
    """The nvidia-cutlass wheel the headers came from (version from its dist-info)."""
    site = include.parents[2]
    for dist in sorted(site.glob("nvidia_cutlass-*.dist-info")):
        meta = (dist / "METADATA").read_text()
        version = re.search(r"^Version: (.+)$", meta, re.M).group(1)
        return {"name": "nvidia-cutlass", "version": version}
    return {"name": "nvidia-cutlass", "version": "unknown"}


def _write_markdown(path: Path, doc: dict) -> None:
    lines = [
        "# CUTLASS shared-memory probe: results",
        "",
        f"Generated by `{doc['command']}` on {doc['date']} ({doc['host']}).",
        f"CUTLASS {doc['cutlass_version']} headers from the `{doc['package']['name']}` "
        f"{doc['package']['version']} wheel; {doc['nvcc']}. No GPU was used: values are host-side constexpr/sizeof.",
        "",
        "Columns: stages chosen by `StageCountAutoCarveout<sizeof(epilogue SharedStorage)>`; mainloop = "
        "`sizeof(CollectiveMainloop::SharedStorage)`; epilogue = `sizeof(CollectiveEpilogue::SharedStorage)` (the "
        "carve-out); kernel = `GemmKernel::SharedStorageSize` (what the launch asks for); fits = kernel <= capacity.",
        "",
        "Full build: the listed combinations were also compiled as complete kernels (device code included); "
        "'not run' = host-only pass.",
        "",
        "| combination | stages | A+B+SF (all stages) | mainloop | epilogue | kernel | capacity | fits | full build |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in doc["results"]:
        if r["status"] != "ok":
            lines.append(f"| `{r['id']}` | - | - | - | - | - | - | does not compile: {r['reason']} | "
                         f"{r['full_build']} |")
            continue
        ab = r["smem_a_bytes"] + r["smem_b_bytes"] + r.get("smem_sfa_bytes", 0) + r.get("smem_sfb_bytes", 0)
        fits = "yes" if r["kernel_smem_bytes"] <= r["capacity_bytes"] else "**no**"
        lines.append(f"| `{r['id']}` | {r['stages']} | {ab:,} | {r['mainloop_smem_bytes']:,} | "
                     f"{r['epilogue_smem_bytes']:,} | {r['kernel_smem_bytes']:,} | {r['capacity_bytes']:,} | {fits} | "
                     f"{r['full_build']} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--include", required=True, type=Path,
                        help="CUTLASS include dir (cutlass_library/source/include)")
    parser.add_argument("--nvcc", default="nvcc")
    parser.add_argument("--jobs", type=int, default=1, help="parallel nvcc processes")
    parser.add_argument("--only", default="", help="regex: probe only combination ids matching it (for debugging)")
    parser.add_argument("--out", type=Path, default=HERE, help="directory for results.json / results.md")
    parser.add_argument("--skip-full-build", action="store_true", help="skip the complete-kernel builds (FULL_BUILD)")
    args = parser.parse_args()

    combos = [c for c in combinations() if re.search(args.only, c["id"])]
    groups: list[tuple[str, str, list[dict]]] = []
    for arch in ARCH_FLAGS:
        mine = [c for c in combos if c["arch"] == arch]
        for i in range(0, len(mine), GROUP_SIZE):
            groups.append((arch, f"{arch}_g{i // GROUP_SIZE:02d}", mine[i:i + GROUP_SIZE]))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    results: dict[str, dict] = {}
    full: dict[str, dict] = {}
    with (tempfile.TemporaryDirectory(prefix="cutlass-probe-") as tmp,
          concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool):
        futures = [pool.submit(_compile_and_run, args.nvcc, args.include, arch, group, Path(tmp), name, log)
                   for arch, name, group in groups]
        if not args.skip_full_build:
            futures += [pool.submit(_compile_and_run, args.nvcc, args.include, c["arch"], [c], Path(tmp),
                                    f"full_{i:02d}", log, ("-DPROBE_FULL_BUILD",))
                        for i, c in enumerate(combos) if c["full_build"]]
        n_host = len(groups)
        for i, fut in enumerate(futures):
            (results if i < n_host else full).update(fut.result())
    for cid, rec in results.items():
        if cid in full:
            ok = full[cid]["status"] == "ok"
            rec["full_build"] = "ok" if ok else f"does not compile: {full[cid]['reason']}"
        else:
            rec["full_build"] = "not run"

    order = {c["id"]: i for i, c in enumerate(combos)}
    doc = {
        "schema_version": 1,
        "cutlass_version": _cutlass_version(args.include),
        "package": _package_info(args.include),
        "nvcc": _version([args.nvcc, "--version"]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, no GPU used)",
        "command": "python docs/cutlass-probe/run_probe.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "results": sorted(results.values(), key=lambda r: order[r["id"]]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    _write_markdown(args.out / "results.md", doc)
    ok = sum(r["status"] == "ok" for r in doc["results"])
    log(f"{ok} combinations measured, {len(doc['results']) - ok} rejected by CUTLASS; wrote {args.out}/results.*")
    return 0


if __name__ == "__main__":
    sys.exit(main())
