"""Real loopback servers for the load tests: the stamped selftest server, in a thread or a process."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from servescope.load.selftest_server import SelftestServerConfig, serve_in_thread


@pytest.fixture
def fast_server() -> Iterator[str]:
    """500 tokens/s per stream, 2 tokens per chunk, 5 ms to first token."""
    with serve_in_thread(SelftestServerConfig(tokens_per_s=500.0, tokens_per_chunk=2, ttft_ms=5.0)) as url:
        yield url


@pytest.fixture
def closed_port() -> int:
    """A loopback port with nothing listening (bound, then released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_server_process(*args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "servescope.load.selftest_server", "--port", "0", *args],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    assert line.startswith("PORT "), line
    return proc, f"http://127.0.0.1:{int(line.split()[1])}"
