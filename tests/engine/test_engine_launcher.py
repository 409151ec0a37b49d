"""The launcher against a real ``transformers serve`` on loopback (CPU, tiny random MoE)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from servescope.engine.launcher import (
    EngineConfig,
    EngineHandle,
    build_command,
    find_free_port,
    last_log_line,
    merge_args,
    start_engine,
)
from servescope.errors import ConfigError, EngineError

from .sse import post_json, stream

pytestmark = pytest.mark.engine


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(0); it is gone for our purposes once its state is Z.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _connect_refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


def _assert_fully_stopped(handle: EngineHandle) -> None:
    port = int(handle.base_url.rsplit(":", 1)[1])
    assert _process_gone(handle.pid)
    assert _group_gone(handle.pid)
    assert handle.process.returncode is not None
    assert _connect_refused(port)
    assert _port_free(port)


# ----- requests against one running server -----


def test_handle_describes_the_running_server(hf_engine: EngineHandle, tiny_model_dir: Path):
    assert hf_engine.base_url.startswith("http://127.0.0.1:")
    assert hf_engine.served_model == "servescope-tiny-moe"
    assert hf_engine.kind == "transformers"
    assert hf_engine.model_dir == tiny_model_dir
    assert hf_engine.is_running()
    assert hf_engine.metrics_url is None
    assert 0 < hf_engine.startup_s < 120
    assert "--continuous-batching" in hf_engine.command
    assert hf_engine.command[hf_engine.command.index("--cb-num-blocks") + 1] == "512"
    with urllib.request.urlopen(f"{hf_engine.base_url}/v1/models", timeout=10) as reply:
        ids = [m["id"] for m in json.loads(reply.read())["data"]]
    assert ids == ["servescope-tiny-moe"]


@pytest.mark.parametrize("max_tokens", [1, 17, 64])
def test_streamed_completion_has_exactly_max_tokens(hf_engine: EngineHandle, max_tokens: int):
    result = stream(
        f"{hf_engine.base_url}/v1/completions",
        {"model": hf_engine.served_model, "prompt": "The knee of the curve is", "max_tokens": max_tokens},
    )
    assert result.status == 200, result.body
    assert result.usage is not None
    assert result.usage["completion_tokens"] == max_tokens
    assert result.finish_reasons == ["length"]  # "stop" would mean an EOS was sampled


def test_streamed_chat_completion_has_exactly_max_tokens(hf_engine: EngineHandle):
    result = stream(
        f"{hf_engine.base_url}/v1/chat/completions",
        {"model": hf_engine.served_model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 48},
    )
    assert result.status == 200, result.body
    assert result.usage["completion_tokens"] == 48
    assert result.finish_reasons == ["length"]
    assert any(c.get("delta", {}).get("content") for e in result.events for c in e.get("choices", []))


def test_concurrent_streams_each_get_their_length(hf_engine: EngineHandle):
    lengths = [8, 24, 40, 56, 72, 96]

    def one(n: int) -> int:
        result = stream(
            f"{hf_engine.base_url}/v1/completions",
            {"model": hf_engine.served_model, "prompt": f"request {n}", "max_tokens": n, "temperature": 0.0},
        )
        assert result.status == 200, result.body
        return int(result.usage["completion_tokens"])

    with ThreadPoolExecutor(max_workers=len(lengths)) as pool:
        assert list(pool.map(one, lengths)) == lengths


def test_benchmark_client_extra_fields_are_accepted(hf_engine: EngineHandle):
    """The fields sglang's and vLLM's clients send (422 on the stock server) are accepted; ignore_eos is honoured."""
    extras = {
        "ignore_eos": True,
        "min_tokens": 32,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "best_of": 1,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": False,
        "some_future_field": {"nested": [1, 2]},
    }
    for path, body in (
        ("/v1/completions", {"prompt": "ignore_eos test"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        request = {"model": hf_engine.served_model, "max_tokens": 32, **body, **extras}
        result = stream(f"{hf_engine.base_url}{path}", request)
        assert result.status == 200, f"{path}: {result.body}"
        assert result.usage["completion_tokens"] == 32
    status, text = post_json(
        f"{hf_engine.base_url}/v1/completions",
        {"model": hf_engine.served_model, "prompt": "x", "max_tokens": 5, "ignore_eos": True},
    )
    assert status == 200, text
    assert json.loads(text)["usage"]["completion_tokens"] == 5


def test_known_fields_are_still_validated(hf_engine: EngineHandle):
    """Widening the schema does not switch validation off: a wrong model name is still an error."""
    status, _ = post_json(f"{hf_engine.base_url}/v1/completions", {"model": "no-such-model", "prompt": "x"})
    assert status == 400


def test_ignore_eos_is_honoured_under_continuous_batching(tiny_model_dir: Path, tmp_path: Path):
    """A model that always wants to stop: without ignore_eos one token and "stop"; with it, exactly max_tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    eager = tmp_path / "eager-eos"
    shutil.copytree(tiny_model_dir, eager)
    weights = load_file(eager / "model.safetensors")
    channel = weights["lm_head.weight"].shape[1] - 1
    weights["lm_head.weight"][2, channel] = 100.0  # <|im_end|> (EOS) now wins every step
    save_file(weights, eager / "model.safetensors", metadata={"format": "pt"})

    with start_engine(EngineConfig(model_dir=eager, log_path=tmp_path / "eos.log")) as handle:
        url = f"{handle.base_url}/v1/completions"
        plain = stream(url, {"model": handle.served_model, "prompt": "x", "max_tokens": 20})
        assert plain.status == 200, plain.body
        assert plain.finish_reasons == ["stop"]
        assert plain.usage["completion_tokens"] == 1
        forced = stream(url, {"model": handle.served_model, "prompt": "x", "max_tokens": 20, "ignore_eos": True})
        assert forced.status == 200, forced.body
        assert forced.usage["completion_tokens"] == 20
        assert forced.finish_reasons == ["length"]


# ----- lifecycle: each test starts its own server -----


def test_clean_exit_leaves_no_process_and_a_free_port(tiny_model_dir: Path, tmp_path: Path):
    log_path = tmp_path / "engine.log"
    with start_engine(EngineConfig(model_dir=tiny_model_dir, log_path=log_path, warmup=False)) as handle:
        assert handle.is_running()
    _assert_fully_stopped(handle)
    assert "Uvicorn running on" in log_path.read_text()


def test_exception_and_interrupt_inside_the_block_stop_the_server(tiny_model_dir: Path, tmp_path: Path):
    """An error in the caller, then a Ctrl-C (KeyboardInterrupt), each stop the server and propagate.

    The second server also proves ``extra_args`` reach transformers serve: a tiny KV cache (8 blocks of 32 tokens)
    still serves a request.
    """
    seen: list[EngineHandle] = []
    cfg = EngineConfig(model_dir=tiny_model_dir, log_path=tmp_path / "a.log", warmup=False)
    with pytest.raises(RuntimeError, match="boom"), start_engine(cfg) as h:
        seen.append(h)
        raise RuntimeError("boom")
    _assert_fully_stopped(seen[-1])

    cfg = EngineConfig(model_dir=tiny_model_dir, log_path=tmp_path / "b.log", extra_args=("--cb-num-blocks", "8"))
    with pytest.raises(KeyboardInterrupt), start_engine(cfg) as h:
        seen.append(h)
        assert h.command.count("--cb-num-blocks") == 1
        assert h.command[h.command.index("--cb-num-blocks") + 1] == "8"
        result = stream(f"{h.base_url}/v1/completions", {"model": h.served_model, "prompt": "x", "max_tokens": 9})
        assert result.usage["completion_tokens"] == 9
        raise KeyboardInterrupt
    _assert_fully_stopped(seen[-1])


def test_stop_with_streams_in_flight_is_prompt(tiny_model_dir: Path, tmp_path: Path):
    """Ctrl-C during a sweep: open streams do not hold the server up for the whole grace period."""
    results: list[object] = []

    def long_stream(url: str, model: str) -> None:
        try:
            results.append(stream(f"{url}/v1/completions", {"model": model, "prompt": "x", "max_tokens": 4000}))
        except (OSError, ValueError, http.client.HTTPException) as err:  # the stream is cut mid-chunk
            results.append(err)

    cfg = EngineConfig(model_dir=tiny_model_dir, log_path=tmp_path / "f.log", stop_grace_s=30)
    with start_engine(cfg) as handle:
        threads = [threading.Thread(target=long_stream, args=(handle.base_url, handle.served_model)) for _ in range(3)]
        for thread in threads:
            thread.start()
        time.sleep(1.5)
        stop_started = time.monotonic()
    stop_s = time.monotonic() - stop_started
    _assert_fully_stopped(handle)
    for thread in threads:
        thread.join(timeout=30)
    assert len(results) == 3
    assert stop_s < 10  # force-quit after FORCE_QUIT_AFTER_S, well before the 30 s grace


def test_server_dies_with_a_sigkilled_parent(tiny_model_dir: Path, tmp_path: Path):
    """If servescope itself is SIGKILLed (no finally runs), the kernel's parent-death signal stops the server."""
    info = tmp_path / "info.json"
    script = textwrap.dedent(
        f"""
        import json, time
        from pathlib import Path
        from servescope.engine.launcher import EngineConfig, start_engine
        cfg = EngineConfig(model_dir=Path({str(tiny_model_dir)!r}), log_path=Path({str(tmp_path / "k.log")!r}),
                           warmup=False)
        with start_engine(cfg) as h:
            Path({str(info)!r}).write_text(json.dumps({{"pid": h.pid, "url": h.base_url}}))
            time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 120
        while not info.exists():
            assert parent.poll() is None, "launcher script exited early"
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        pid = json.loads(info.read_text())["pid"]
        port = int(json.loads(info.read_text())["url"].rsplit(":", 1)[1])
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 20
        while not (_process_gone(pid) and _port_free(port)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _process_gone(pid)
        assert _port_free(port)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_missing_model_folder_fails_at_once(tmp_path: Path):
    started = time.monotonic()
    with pytest.raises(EngineError, match="does not exist"), start_engine(EngineConfig(model_dir=tmp_path / "nope")):
        pass
    assert time.monotonic() - started < 1.0


def test_broken_model_folder_fails_fast_with_the_log_line(tmp_path: Path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "qwen3_moe", "hidden_size": 128}')
    log_path = tmp_path / "broken.log"
    started = time.monotonic()
    cfg = EngineConfig(model_dir=broken, log_path=log_path, startup_timeout_s=90)
    with pytest.raises(EngineError) as info, start_engine(cfg):
        pass
    elapsed_s = time.monotonic() - started
    message = str(info.value)
    assert "exited with status" in message
    assert str(log_path) in message
    assert "\n" not in message
    assert elapsed_s < 60  # the process death is noticed, not the 90 s timeout


def test_startup_timeout_stops_the_process(tiny_model_dir: Path, tmp_path: Path):
    cfg = EngineConfig(model_dir=tiny_model_dir, log_path=tmp_path / "t.log", startup_timeout_s=0.5)
    with pytest.raises(EngineError, match="not healthy after"), start_engine(cfg):
        pass
    # The command line is the first line of the log; the process it started must be gone.
    assert "servescope:" in (tmp_path / "t.log").read_text()
    time.sleep(0.2)
    out = subprocess.run(["pgrep", "-f", str(tmp_path / "t.log")], capture_output=True, text=True)
    assert out.stdout.strip() == ""


def test_taken_port_is_reported(tiny_model_dir: Path, tmp_path: Path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        cfg = EngineConfig(model_dir=tiny_model_dir, port=port, log_path=tmp_path / "p.log")
        with pytest.raises(EngineError, match="already in use"), start_engine(cfg):
            pass


# ----- pure helpers -----


def test_merge_args_lets_extra_flags_replace_defaults():
    defaults = ["--continuous-batching", "--cb-block-size", "32", "--cb-num-blocks", "512"]
    assert merge_args(defaults, []) == defaults
    assert merge_args(defaults, ["--cb-num-blocks", "16"]) == [
        "--continuous-batching",
        "--cb-block-size",
        "32",
        "--cb-num-blocks",
        "16",
    ]
    assert merge_args(defaults, ["--cb-num-blocks=16"])[-1] == "--cb-num-blocks=16"
    assert "--continuous-batching" not in merge_args(defaults, ["--no-continuous-batching"])
    assert merge_args(["--max-num-seqs", "32"], ["--max-num-seqs", "4", "--enforce-eager"]) == [
        "--max-num-seqs",
        "4",
        "--enforce-eager",
    ]


def test_build_command_for_each_engine(tmp_path: Path):
    hf = build_command(EngineConfig(model_dir=tmp_path, device="cuda"), 8123, "m")
    assert hf[1:3] == ["-m", "servescope.engine.hf_serve_entry"]
    assert "--cb-num-blocks" not in hf  # GPU: transformers' own KV sizing
    assert hf[hf.index("--port") + 1] == "8123"
    cfg = EngineConfig(kind="vllm", model_dir=tmp_path, python="/opt/py", extra_args=("--max-num-seqs", "4"))
    vl = build_command(cfg, 9, "m")
    assert vl[:3] == ["/opt/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert vl[vl.index("--max-num-seqs") + 1] == "4"
    assert vl.count("--max-num-seqs") == 1
    with pytest.raises(ConfigError):
        build_command(EngineConfig(kind="sglang", model_dir=tmp_path), 9, "m")  # type: ignore[arg-type]


def test_last_log_line_prefers_the_error(tmp_path: Path):
    log = tmp_path / "x.log"
    log.write_text(
        'INFO loading\nTraceback (most recent call last):\n  File "x.py", line 1\n'
        "OSError: model.safetensors not found\nLoading weights: 100%|####| 3/3\n\n"
    )
    assert last_log_line(log) == "OSError: model.safetensors not found"
    log.write_text("just info\nmore info\n")
    assert last_log_line(log) == "more info"
    assert last_log_line(tmp_path / "missing.log") == "(empty log)"


def test_find_free_port_is_bindable():
    assert _port_free(find_free_port())
