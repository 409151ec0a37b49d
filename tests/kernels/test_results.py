"""Results files: written, read back identically, rendered; broken files are clear errors."""

from __future__ import annotations

import json

import pytest

from servescope.errors import RunDataError
from servescope.kernels.results import MARKDOWN_FILE, RESULTS_FILE, read_results, render_markdown, write_results

from .factory import point, results


def test_write_then_read_round_trips_every_field(tmp_path):
    res = results([point("triton", 1, 95.0), point("torch-loop", 1, 40.0), point("triton", 4, None, status="wrong")])
    path = write_results(tmp_path / "out", res)
    assert path.name == RESULTS_FILE
    data = json.loads(path.read_text())
    assert data["schema_version"] == 1 and data["kind"] == "servescope.kernels"
    assert data["points"][0]["time_us"] == pytest.approx(100.0 * 100.0 / 95.0)
    back = read_results(tmp_path / "out")  # the directory works as well as the file
    assert back == res
    assert read_results(path) == res


def test_markdown_lists_each_point_failures_and_unavailable_backends(tmp_path):
    res = results([point("triton", 1, 95.0), point("torch-loop", 1, 40.0), point("triton", 4, None, status="wrong")])
    md = render_markdown(res)
    assert "| triton | 1 | ok |" in md
    assert "**wrong**" in md and "made-up failure" in md
    assert "deepgemm" in md and "not installed" in md
    assert "4.20 TB/s" in md
    write_results(tmp_path, res)
    assert (tmp_path / MARKDOWN_FILE).read_text() == md


def test_missing_foreign_and_future_files_are_run_data_errors(tmp_path):
    with pytest.raises(RunDataError, match="no kernels results"):
        read_results(tmp_path)
    (tmp_path / RESULTS_FILE).write_text(json.dumps({"schema_version": 1, "kind": "something-else"}))
    with pytest.raises(RunDataError, match="not a servescope kernels results file"):
        read_results(tmp_path)
    (tmp_path / RESULTS_FILE).write_text(json.dumps({"schema_version": 99, "kind": "servescope.kernels"}))
    with pytest.raises(RunDataError, match="schema_version 99"):
        read_results(tmp_path)
    (tmp_path / RESULTS_FILE).write_text("{not json")
    with pytest.raises(RunDataError, match="not valid JSON"):
        read_results(tmp_path)
    (tmp_path / RESULTS_FILE).write_text(json.dumps({"schema_version": 1, "kind": "servescope.kernels"}))
    with pytest.raises(RunDataError, match="malformed"):
        read_results(tmp_path)
