"""`servescope run` end to end against the embedded engine: a real `transformers serve` on loopback.

The KV cache is made deliberately small (`--cb-num-blocks 4` of 32 tokens = 128 token slots,
so two 64-token sequences fit at once): the server then runs at most 2 requests and queues
the rest. The diagnosis must name that ceiling, from the first concurrency beyond it, with
its evidence, and the report must be written. Interrupting a run must keep what it recorded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    e = dict(os.environ)
    e["SERVESCOPE_CACHE"] = str(tmp_path_factory.mktemp("model-cache"))
    e["PYTHONUNBUFFERED"] = "1"
    return e


def _servescope(*args: str, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "servescope", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_run_with_small_kv_cache_names_the_ceiling(tmp_path, env):
    out = tmp_path / "run"
    res = _servescope("run", "--concurrency", "1,2,4,8", "--input-len", "32", "--output-len", "32",
                      "--engine-arg=--cb-num-blocks=4", "--out", str(out), env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == str(out)
    diagnosis = json.loads((out / "diagnosis.json").read_text())
    by_id = {f["id"]: f for f in diagnosis["findings"]}
    assert "scheduler_ceiling" in by_id, diagnosis
    ceiling = by_id["scheduler_ceiling"]
    assert "~2 running" in ceiling["title"], ceiling["title"]
    summary = json.loads((out / "summary.json").read_text())
    point_conc = {p["point"]: p["target_concurrency"] for p in summary["points"]}
    # Two sequences fit; the first point that must queue is c=4.
    assert [point_conc[i] for i in ceiling["points"]] == [4]
    labels = " ".join(e["label"] for e in ceiling["evidence"])
    assert "waiting for first token" in labels and "TTFT p50" in labels
    assert any("--cb-num-blocks" in r for r in ceiling["recommendations"])
    # Every measured request got exactly the requested tokens (EOS unsampleable; server usage counted).
    for p in summary["points"]:
        assert p["failed"] == 0
        assert p["total_output_tokens"] == 32 * p["completed"]
    html = (out / "report.html").read_text()
    assert "Scheduler / KV ceiling" in html and "<svg" in html
    assert (out / "report.md").exists() and (out / "engine.log").exists()


def test_interrupted_run_keeps_records_and_reports(tmp_path, env):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "servescope", "run", "--concurrency", "2,4,8", "--input-len", "32",
         "--output-len", "256", "--num-prompts", "400", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    requests = out / "requests.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if requests.exists() and requests.read_text().count("\n") >= 6:
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("no requests recorded within 300 s: " + proc.stderr.read()[-2000:] if proc.stderr else "")
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    lines = [json.loads(x) for x in requests.read_text().splitlines() if x.strip()]
    assert len(lines) >= 6
    assert (out / "report.html").exists(), "an interrupted run must still be reported"
    # The engine is gone: its port is free again.
    cfg = json.loads((out / "config.json").read_text())
    port = int(cfg["target"]["url"].rsplit(":", 1)[1])
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    # And `servescope report` rebuilds from the files alone.
    (out / "summary.json").unlink(missing_ok=True)
    res = _servescope("report", str(out), env=env)
    assert res.returncode == 0, res.stderr
    assert (out / "report.md").read_text().strip()


def test_run_rejects_bad_flags_in_one_line(tmp_path, env):
    res = _servescope("run", "--concurrency", "4,x", "--out", str(tmp_path / "r"), env=env, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "--concurrency" in res.stderr
    res = _servescope("run", "--url", "http://127.0.0.1:9", "--engine-arg=--cb-num-blocks=4",
                      "--out", str(tmp_path / "r2"), env=env, timeout=120)
    assert res.returncode == 2 and "embedded engine only" in res.stderr
