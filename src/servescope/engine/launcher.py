"""Start a real inference server on loopback, wait until it serves, and always stop it.

``start_engine(EngineConfig(...))`` is a context manager. It launches ``transformers serve`` (through our
``hf_serve_entry``, which makes it accept the extra fields benchmark clients send) or vLLM's OpenAI server in a process
group of its own, polls ``/health`` until the server answers (failing fast, with the log's last meaningful line, if the
process dies), sends one tiny warm-up request, and yields an ``EngineHandle``. On leaving the block, normally, on an
exception or on KeyboardInterrupt, it sends SIGTERM to the whole process group, then SIGKILL after a grace period, reaps
it and waits until the port is free again: no orphan process, no port left bound.

Why a new session (process group): the server must not receive the terminal's Ctrl-C directly (it would die mid-run
with a traceback while we still measure); we stop it ourselves, whole group at once, which also reaches children such
as vLLM's engine-core process. Why PR_SET_PDEATHSIG on Linux (set by a tiny exec shim): if servescope itself is killed
with SIGKILL, no ``finally`` runs; the kernel then sends the server SIGTERM so it does not outlive us.

Why a warm-up request: ``transformers serve`` sets up continuous batching (and allocates its KV cache) on the first
request and fixes the sampling parameters of all later requests to that request's; one warm-up request with the
model's own generation config makes "ready" mean ready and those parameters deterministic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from servescope.engine import vllm
from servescope.engine.tiny_model import MARKER_FILE
from servescope.errors import ConfigError, EngineError

logger = logging.getLogger(__name__)

EngineKind = Literal["transformers", "vllm"]
ENGINE_KINDS: tuple[str, ...] = ("transformers", "vllm")
HF_SERVE_ENTRY = "servescope.engine.hf_serve_entry"

# local-engine.md: a small paged KV cache (~650 MB instead of 3.6 GB; first request 0.16 s instead of ~9 s).
# --cb-num-blocks caps how many sequences fit at once: pass a smaller value in extra_args for a KV ceiling.
TRANSFORMERS_CPU_ARGS = ("--continuous-batching", "--cb-block-size", "32", "--cb-num-blocks", "512",
                         "--cb-max-batch-tokens", "2048")  # fmt: skip
# On a GPU, transformers' own CB defaults (as in h200-measurements.md's run).
TRANSFORMERS_CUDA_ARGS = ("--continuous-batching",)

# Default startup limits, seconds: transformers serve starts in 5-8 s, vLLM on CPU in 40-65 s (local-engine.md);
# a GPU load of the ~10 GB preset model took 53 s on the H200 (h200-measurements.md). Generous margins for busy CI.
DEFAULT_STARTUP_TIMEOUT_S = {("transformers", "cpu"): 120.0, ("transformers", "cuda"): 300.0,
                             ("vllm", "cpu"): 300.0, ("vllm", "cuda"): 600.0}  # fmt: skip
HEALTH_POLL_S = 0.25
HEALTH_REQUEST_TIMEOUT_S = 2.0
WARMUP_TIMEOUT_S = 120.0
PORT_RELEASE_TIMEOUT_S = 10.0
# After SIGTERM, how long open streams may finish on their own before we ask the server to force-quit.
FORCE_QUIT_AFTER_S = 2.0
# How many times to retry with a new port when an automatically chosen one was taken before the server bound it.
PORT_RACE_RETRIES = 3
LOG_TAIL_BYTES = 64 * 1024

_MEANINGFUL = re.compile(r"error|exception|failed|traceback|not found|no such|denied|refused|in use|killed", re.I)
_PROGRESS = re.compile(r"\d+%\|")  # tqdm bars
_ADDR_IN_USE = re.compile(r"address already in use|errno 98", re.I)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """What to serve and how. Only ``model_dir`` is required.

    ``extra_args`` go last on the server's command line and replace servescope's default for any flag they name
    (e.g. ``("--cb-num-blocks", "16")`` for a KV ceiling on transformers, ``("--max-num-seqs", "4")`` on vLLM;
    ``--no-continuous-batching`` drops ``--continuous-batching``). ``python`` is the interpreter that runs the server
    (a separate vLLM virtualenv, say); default: the one running servescope.
    """

    kind: EngineKind = "transformers"
    model_dir: Path
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int | None = None
    extra_args: tuple[str, ...] = ()
    startup_timeout_s: float | None = None
    log_path: Path | None = None
    python: str | None = None
    served_model_name: str | None = None
    stop_grace_s: float = 10.0
    warmup: bool = True
    env: tuple[tuple[str, str], ...] = ()

    def resolved_startup_timeout_s(self) -> float:
        """The startup limit: the configured one, else a default for the engine and device."""
        if self.startup_timeout_s is not None:
            return self.startup_timeout_s
        return DEFAULT_STARTUP_TIMEOUT_S.get((self.kind, _device_type(self.device)), 300.0)


@dataclass(frozen=True, slots=True)
class EngineHandle:
    """A running server. ``base_url`` has no trailing slash; put ``served_model`` in requests' ``model`` field."""

    kind: str
    base_url: str
    served_model: str
    pid: int
    log_path: Path
    command: list[str]
    model_dir: Path
    device: str
    startup_s: float
    # Prometheus endpoint, where the engine has one (vLLM); transformers serve has none.
    metrics_url: str | None
    process: subprocess.Popen = field(repr=False, compare=False)

    def is_running(self) -> bool:
        """Whether the server process is still alive."""
        return self.process.poll() is None

    def ensure_running(self) -> None:
        """Raise ``EngineError`` with the log's last meaningful line if the server has exited."""
        code = self.process.poll()
        if code is not None:
            raise EngineError(
                f"{self.kind} server exited with status {code} during the run: {last_log_line(self.log_path)} "
                f"(full log: {self.log_path})"
            )

    def log_tail(self, max_bytes: int = LOG_TAIL_BYTES) -> str:
        """The end of the server's log (for reports and error messages)."""
        return _read_tail(self.log_path, max_bytes)


@contextlib.contextmanager
def start_engine(cfg: EngineConfig) -> Iterator[EngineHandle]:
    """Start the server, wait until it is healthy (and warmed up), yield its handle, and stop it on exit.

    Raises ``EngineError`` (one line: what failed, the log's last meaningful line, the log path) if the server cannot
    start, and ``ConfigError`` for an unusable configuration. The server is stopped on every exit path.
    """
    handle = _launch(cfg)
    try:
        yield handle
    finally:
        stop_engine(handle, cfg.stop_grace_s)


def stop_engine(handle: EngineHandle, grace_s: float = 10.0) -> None:
    """SIGTERM the server's process group, SIGKILL it after ``grace_s``, reap it, and wait for its port to be free."""
    _stop_group(handle.process, grace_s)
    host, port = _host_port(handle.base_url)
    if not _wait_port_free(host, port, PORT_RELEASE_TIMEOUT_S):
        logger.warning("port %s:%d still bound %.0f s after the server stopped", host, port, PORT_RELEASE_TIMEOUT_S)
    logger.info("%s server (pid %d) stopped", handle.kind, handle.pid)


def build_command(cfg: EngineConfig, port: int, served_model: str) -> list[str]:
    """The exact command line for ``cfg`` on ``port`` (defaults first, then ``extra_args``, which win)."""
    python = cfg.python or sys.executable
    model_dir = Path(cfg.model_dir)
    if cfg.kind == "transformers":
        defaults = list(TRANSFORMERS_CPU_ARGS if _device_type(cfg.device) == "cpu" else TRANSFORMERS_CUDA_ARGS)
        base = [python, "-m", HF_SERVE_ENTRY, str(model_dir), "--served-model-name", served_model,
                "--device", cfg.device, "--host", cfg.host, "--port", str(port)]  # fmt: skip
    elif cfg.kind == "vllm":
        defaults = vllm.default_args(_device_type(cfg.device))
        base = vllm.base_command(python, model_dir, served_model, cfg.host, port)
    else:
        raise ConfigError(f"unknown engine {cfg.kind!r}; use one of: {', '.join(ENGINE_KINDS)}")
    return base + merge_args(defaults, list(cfg.extra_args))


def merge_args(defaults: list[str], extra: list[str]) -> list[str]:
    """``defaults`` without the flags ``extra`` names (``--x v``, ``--x=v``, ``--no-x``), then ``extra``.

    A default flag takes the following token as its value unless that token is itself a flag.
    """
    named = set()
    for token in extra:
        if token.startswith("--"):
            name = token.split("=", 1)[0]
            named.add(name)
            if name.startswith("--no-"):
                named.add("--" + name[len("--no-") :])
            else:
                named.add("--no-" + name[2:])
    kept: list[str] = []
    i = 0
    while i < len(defaults):
        token = defaults[i]
        has_value = i + 1 < len(defaults) and not defaults[i + 1].startswith("--") and "=" not in token
        width = 2 if has_value else 1
        if token.split("=", 1)[0] not in named:
            kept.extend(defaults[i : i + width])
        i += width
    return kept + extra


def served_name_for(model_dir: Path) -> str:
    """A short model name for requests: the servescope build's spec name, else the folder's name."""
    marker = Path(model_dir) / MARKER_FILE
    try:
        return str(json.loads(marker.read_text(encoding="utf-8"))["spec"]["name"])
    except (OSError, ValueError, KeyError, TypeError):
        return Path(model_dir).name or "model"


def last_log_line(log_path: Path) -> str:
    """The log's last line that looks like an error (else its last non-empty line), for one-line messages."""
    lines = []
    for raw in _read_tail(log_path, LOG_TAIL_BYTES).splitlines():
        line = raw.rsplit("\r", 1)[-1].strip()  # tqdm redraws with \r: keep the final state
        if line and not _PROGRESS.search(line):
            lines.append(line)
    if not lines:
        return "(empty log)"
    for line in reversed(lines):
        if _MEANINGFUL.search(line) and not line.startswith("File "):
            return line[:300]
    return lines[-1][:300]


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on ``host`` now (another process may still take it before the server binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# ----- internals -----


def _launch(cfg: EngineConfig) -> EngineHandle:
    if cfg.kind not in ENGINE_KINDS:
        raise ConfigError(f"unknown engine {cfg.kind!r}; use one of: {', '.join(ENGINE_KINDS)}")
    model_dir = Path(cfg.model_dir).expanduser()
    if not model_dir.is_dir():
        raise EngineError(
            f"model folder {model_dir} does not exist; build one with build_tiny_moe() or pass a HF model folder"
        )
    if not (model_dir / "config.json").is_file():
        raise EngineError(f"{model_dir} has no config.json: not a Hugging Face model folder")
    served = cfg.served_model_name or served_name_for(model_dir)

    if cfg.log_path is None:  # a temp log is kept after the run, for post-mortems; callers usually pass one
        fd, name = tempfile.mkstemp(prefix=f"servescope-{cfg.kind}-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    else:
        log_path = Path(cfg.log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)

    attempts = 1 if cfg.port is not None else PORT_RACE_RETRIES
    for attempt in range(1, attempts + 1):
        port = cfg.port if cfg.port is not None else find_free_port(cfg.host)
        try:
            return _launch_on_port(cfg, model_dir, served, port, log_path)
        except _PortTaken:
            if attempt == attempts:
                raise EngineError(
                    f"{cfg.kind} server could not bind {cfg.host}:{port}: address already in use; "
                    "pick another --port or stop what holds it"
                ) from None
            logger.info("port %d was taken before the server bound it; retrying on another", port)
    raise AssertionError("unreachable")  # pragma: no cover


class _PortTaken(Exception):
    """The server died because its (automatically chosen) port was taken meanwhile."""


def _launch_on_port(cfg: EngineConfig, model_dir: Path, served: str, port: int, log_path: Path) -> EngineHandle:
    command = build_command(cfg, port, served)
    env = _server_env(cfg)
    base_url = f"http://{_url_host(cfg.host)}:{port}"
    logger.info("starting %s server: %s (log: %s)", cfg.kind, " ".join(command), log_path)
    started_s = time.perf_counter()
    with open(log_path, "ab") as log_file:
        log_file.write(f"\n=== servescope: {' '.join(command)}\n".encode())
        log_file.flush()
        argv = _with_parent_death_signal(command) if _can_use_pdeathsig() else command
        try:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        except OSError as err:
            raise EngineError(f"cannot start {cfg.kind} server ({command[0]}): {err}") from err
    handle = EngineHandle(
        kind=cfg.kind,
        base_url=base_url,
        served_model=served,
        pid=process.pid,
        log_path=log_path,
        command=command,
        model_dir=model_dir,
        device=cfg.device,
        startup_s=0.0,
        metrics_url=f"{base_url}/metrics" if cfg.kind == "vllm" else None,
        process=process,
    )
    try:
        _wait_healthy(handle, cfg.resolved_startup_timeout_s(), started_s)
        if cfg.warmup:
            _warm_up(handle)
    except BaseException:
        _stop_group(process, cfg.stop_grace_s)
        raise
    startup_s = time.perf_counter() - started_s
    logger.info("%s server healthy at %s after %.1f s", cfg.kind, base_url, startup_s)
    return dataclasses.replace(handle, startup_s=startup_s)


def _server_env(cfg: EngineConfig) -> dict[str, str]:
    env = dict(os.environ)
    # Never download: the model is local and these machines have no hub. PYTHONUNBUFFERED: a timely log.
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
                "PYTHONUNBUFFERED": "1"})  # fmt: skip
    if cfg.kind == "vllm":
        for key, value in vllm.default_env(_device_type(cfg.device)).items():
            env.setdefault(key, value)
    env.update(dict(cfg.env))
    return env


def _wait_healthy(handle: EngineHandle, timeout_s: float, started_s: float) -> None:
    url = f"{handle.base_url}/health"
    deadline = started_s + timeout_s
    while True:
        code = handle.process.poll()
        if code is not None:
            line = last_log_line(handle.log_path)
            if _ADDR_IN_USE.search(_read_tail(handle.log_path, 8192)):
                raise _PortTaken()
            raise EngineError(
                f"{handle.kind} server exited with status {code} while starting: {line} (full log: {handle.log_path})"
            )
        try:
            with urllib.request.urlopen(url, timeout=HEALTH_REQUEST_TIMEOUT_S) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError, ValueError):
            pass  # not listening yet, or 503 while it loads
        if time.perf_counter() > deadline:
            raise EngineError(
                f"{handle.kind} server not healthy after {timeout_s:.0f} s: {last_log_line(handle.log_path)} "
                f"(full log: {handle.log_path}); raise the startup timeout if the machine is slow"
            )
        time.sleep(HEALTH_POLL_S)


def _warm_up(handle: EngineHandle) -> None:
    """One non-streaming 1-token completion, so the first measured request does not pay engine set-up."""
    body = json.dumps({"model": handle.served_model, "prompt": "warm up", "max_tokens": 1}).encode()
    request = urllib.request.Request(
        f"{handle.base_url}/v1/completions", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=WARMUP_TIMEOUT_S) as reply:
            reply.read()
    except urllib.error.HTTPError as err:
        detail = err.read().decode("utf-8", "replace")[:200]
        raise EngineError(f"{handle.kind} server rejected the warm-up request: HTTP {err.code} {detail}") from err
    except (urllib.error.URLError, OSError) as err:
        raise EngineError(
            f"{handle.kind} server failed the warm-up request ({err}): {last_log_line(handle.log_path)} "
            f"(full log: {handle.log_path})"
        ) from err


def _stop_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the group, wait up to ``grace_s`` for every member to exit, then SIGKILL; always reap the leader."""
    pgid = process.pid  # start_new_session: the leader's pid is the group id
    if _group_alive(pgid) or process.poll() is None:
        _signal_group(pgid, signal.SIGTERM)
        started = time.monotonic()
        force_sent = False
        while time.monotonic() - started < grace_s:
            process.poll()  # reap the leader as soon as it exits (a zombie still counts as a group member)
            if not _group_alive(pgid):
                break
            if not force_sent and time.monotonic() - started > FORCE_QUIT_AFTER_S:
                # uvicorn waits for open streams to finish after the first signal; a SIGINT after it means "force
                # quit" (uvicorn Server.handle_exit), which closes them. vLLM treats it as a normal shutdown.
                _signal_group(pgid, signal.SIGINT)
                force_sent = True
            time.sleep(0.05)
        else:
            logger.warning("server group %d still alive %.0f s after SIGTERM; sending SIGKILL", pgid, grace_s)
            _signal_group(pgid, signal.SIGKILL)
    try:
        process.wait(timeout=max(grace_s, 5.0))
    except subprocess.TimeoutExpired:
        _signal_group(pgid, signal.SIGKILL)
        process.wait()
    deadline = time.monotonic() + 5.0
    while _group_alive(pgid) and time.monotonic() < deadline:  # members other than the leader
        _signal_group(pgid, signal.SIGKILL)
        time.sleep(0.05)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_port_free(host: str, port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if _port_free(host, port):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _port_free(host: str, port: int) -> bool:
    """Whether a new listener could bind ``host:port`` now (SO_REUSEADDR, as servers set it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _can_use_pdeathsig() -> bool:
    # The signal fires when the *thread* that forked exits, so only arm it from the main thread.
    return sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread()


# Runs first in the child, then becomes the server with exec (same pid, and PR_SET_PDEATHSIG survives exec).
# A shim rather than Popen(preexec_fn=...): preexec_fn runs Python between fork and exec, which can deadlock when
# other threads (telemetry samplers) hold locks at fork time. If the parent is already gone, the shim exits.
_PDEATHSIG_SHIM = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def _with_parent_death_signal(command: list[str]) -> list[str]:
    return [sys.executable, "-c", _PDEATHSIG_SHIM, str(os.getpid()), *command]


def _device_type(device: str) -> str:
    return device.split(":", 1)[0]


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _host_port(base_url: str) -> tuple[str, int]:
    rest = base_url.split("://", 1)[1]
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port)


def _read_tail(path: Path, max_bytes: int) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return ""
