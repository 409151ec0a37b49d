"""Shared helpers for the telemetry tests: the recorded NVML fixture and a real loopback HTTP server."""

from __future__ import annotations

import copy
import http.server
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from servescope.telemetry.fake_nvml import FakeNvml, load_recording

FIXTURES = Path(__file__).parent / "fixtures"
#: Every NVML call of benchmarks/gpu_telemetry_physics.py on a real H200 (see fixtures/README.md).
RECORDING = FIXTURES / "nvml_recording_h200.json.gz"


@pytest.fixture(scope="session")
def recording() -> dict[str, Any]:
    return load_recording(RECORDING)


@pytest.fixture
def fake(recording: dict[str, Any]) -> FakeNvml:
    return FakeNvml(copy.deepcopy(recording))


def derive_recording(recording: dict[str, Any], *, gpus: int = 1, no_gpm: bool = False,
                     energy_frozen: bool = False) -> dict[str, Any]:
    """A DERIVED recording (for cases one healthy H200 cannot show), built from the real one.

    ``gpus``: every GPU-0 call is copied for GPUs 1..n-1 (and nvmlDeviceGetCount answers n);
    ``no_gpm``: nvmlGpmQueryDeviceSupport answers "not supported", as on pre-Hopper GPUs;
    ``energy_frozen``: the energy counter keeps its first value (a window too short for it).
    """
    rec = copy.deepcopy(recording)
    calls: list[dict[str, Any]] = []
    energy_seen: dict[str, Any] = {}
    for c in rec["calls"]:
        if c["fn"] == "nvmlDeviceGetCount" and "result" in c:
            c = {**c, "result": gpus}
        if no_gpm and c["fn"] == "nvmlGpmQueryDeviceSupport" and "result" in c:
            c = {**c, "result": {**c["result"], "isSupportedDevice": 0}}
        if energy_frozen and c["fn"] == "nvmlDeviceGetTotalEnergyConsumption" and "result" in c:
            key = json.dumps(c["args"])
            energy_seen.setdefault(key, c["result"])
            c = {**c, "result": energy_seen[key]}
        calls.append(c)
        on_gpu0 = any(isinstance(a, dict) and a.get("gpu") == 0 for a in c["args"]) or (
            c["fn"] == "nvmlDeviceGetHandleByIndex" and c["args"] == [0])
        for g in range(1, gpus):
            if not on_gpu0:
                continue
            args = [({**a, "gpu": g} if isinstance(a, dict) and a.get("gpu") == 0 else a) for a in c["args"]]
            if c["fn"] == "nvmlDeviceGetHandleByIndex":
                args = [g]
            calls.append({**c, "args": args})
    rec["calls"] = calls
    rec.setdefault("meta", {})["derived"] = {"gpus": gpus, "no_gpm": no_gpm, "energy_frozen": energy_frozen}
    return rec


# ---------------------------------------------------------------------------------------
# A real HTTP server on 127.0.0.1 (free port) with scriptable answers
# ---------------------------------------------------------------------------------------
@dataclass
class Route:
    """Answers for one path: bodies are served in turn (the last one repeats)."""

    bodies: list[str] = field(default_factory=lambda: [""])
    status: int = 200
    delay_s: float = 0.0
    content_type: str = "text/plain; version=0.0.4"
    hits: int = 0


class LoopbackServer:
    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        routes = self.routes

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = routes.get(self.path.split("?")[0])
                if route is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                i = route.hits
                route.hits += 1
                if route.delay_s:
                    time.sleep(route.delay_s)
                body = route.bodies[min(i, len(route.bodies) - 1)].encode()
                try:
                    self.send_response(route.status)
                    self.send_header("Content-Type", route.content_type)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def http_server() -> Iterator[LoopbackServer]:
    srv = LoopbackServer()
    try:
        yield srv
    finally:
        srv.close()


def free_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text()


def derive_per_tick(recording: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """A DERIVED recording in which every sampler tick reads the energy counter and GPM.

    The recorded sampler read energy every ~0.5 s and GPM every ~0.15 s on a real clock;
    a test that steps ``tick()`` by hand cannot reproduce that timing. So, keeping the
    recorded values and their order, each tick (one ``nvmlDeviceGetPowerUsage`` call) is
    given the latest energy and GPM answers recorded before the next tick. Only the
    session's calls are kept (``describe_gpus`` ran first, before the second nvmlInit).
    Returns the recording and how many ticks it holds.
    """
    rec = copy.deepcopy(recording)
    calls = rec["calls"]
    inits = [i for i, c in enumerate(calls) if c["fn"] == "nvmlInit"]
    calls = calls[inits[1]:]
    power_at = [i for i, c in enumerate(calls) if c["fn"] == "nvmlDeviceGetPowerUsage"]
    first_tick = power_at[1]  # power_at[0] is the session's probe
    resampled = ("nvmlDeviceGetTotalEnergyConsumption", "nvmlGpmMetricsGet")
    out = [c for i, c in enumerate(calls) if c["fn"] not in resampled or i < first_tick]
    ticks = power_at[1:]
    for fn in resampled:
        entries = [(i, c) for i, c in enumerate(calls) if c["fn"] == fn and "result" in c]
        for k in range(len(ticks)):
            bound = ticks[k + 1] if k + 1 < len(ticks) else len(calls)
            latest = [c for i, c in entries if i < bound][-1]
            out.append(latest)
    rec["calls"] = out
    rec["meta"] = {**rec.get("meta", {}), "derived": "per-tick energy and GPM answers (tests/telemetry/conftest.py)"}
    return rec, len(ticks)
