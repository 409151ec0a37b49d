"""The transformers-serve entry point's own argument handling (its patches are tested through a real server)."""

from __future__ import annotations

import os
import subprocess
import sys

from servescope.engine.hf_serve_entry import split_args


def test_served_model_name_is_taken_out_of_the_serve_arguments():
    assert split_args(["/m", "--served-model-name", "tiny", "--port", "8"]) == ("tiny", ["/m", "--port", "8"])
    assert split_args(["--served-model-name=tiny", "/m"]) == ("tiny", ["/m"])
    assert split_args(["/m", "--device", "cpu"]) == (None, ["/m", "--device", "cpu"])


def test_entry_runs_the_real_serve_cli():
    """``--help`` reaches transformers' own serve command (so every serve flag is available through us)."""
    out = subprocess.run(
        [sys.executable, "-m", "servescope.engine.hf_serve_entry", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert "--continuous-batching" in out.stdout
    assert "--cb-num-blocks" in out.stdout
