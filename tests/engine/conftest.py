"""Shared fixtures for the embedded-engine tests: one tiny model per test session, one running server per module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from servescope.engine.launcher import EngineConfig, EngineHandle, start_engine
from servescope.engine.tiny_model import build_tiny_moe


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny MoE model, built once per session in a temporary cache (a few seconds)."""
    return build_tiny_moe(cache_dir=tmp_path_factory.mktemp("engine-models"))


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHandle]:
    """A real ``transformers serve`` (through our entry point) on a free loopback port, with default flags."""
    log_path = tmp_path_factory.mktemp("engine-logs") / "transformers.log"
    with start_engine(EngineConfig(model_dir=tiny_model_dir, log_path=log_path)) as handle:
        yield handle
