"""Shared run directories for the report tests: built once per session from real files (see runfactory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from servescope.run import RunDir

from .runfactory import RunSpec, build_run

#: A small seed-shaped sweep: the same shape (knee at the running cap, a flat last step,
#: a heavy ITL tail, 2 failures) with 1/32 of the seed's concurrency, so it builds in ~1 s.
SMALL = dict(concurrencies=(8, 16, 32, 64), tok_s=(704.0, 1106.0, 1601.0, 1640.0), running_cap=32, output_len=32,
             warmup=2, gpus=2, sample_interval_s=0.25)


@pytest.fixture(scope="session")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    return build_run(tmp_path_factory.mktemp("report") / "run", RunSpec(**SMALL))


@pytest.fixture(scope="session")
def malicious_run(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    """Every file-sourced string field carries ``<script>alert(1)</script>``."""
    return build_run(tmp_path_factory.mktemp("report") / "evil", RunSpec(**SMALL, malicious=True))


@pytest.fixture
def fresh_run(tmp_path: Path) -> RunDir:
    """A run the test may damage (crash simulations)."""
    return build_run(tmp_path / "run", RunSpec(**SMALL))
