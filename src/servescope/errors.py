"""The servescope exception tree.

Every error a user can cause (a bad flag, an unknown GPU name, a server that answers
garbage, a broken run directory) is a ``ServescopeError``; the CLI prints its message
as one line on stderr and exits with code 2. Anything else is a bug and keeps its
traceback. Errors are grouped by *where* things went wrong, as httpx groups its own::

    ServescopeError
    ├── ConfigError              a flag, option or config value is invalid
    │   └── UnknownNameError     a GPU / model / format name is not in a catalog
    ├── ModelConfigError         a HF config.json (or quant config) cannot be read
    ├── TargetError              the inference server under test misbehaved
    │   ├── TargetUnreachable    connection refused / DNS / reset before a reply
    │   ├── TargetTimeout        no reply (or no next chunk) within the time limit
    │   ├── TargetHTTPStatus     the server answered 4xx / 5xx
    │   └── StreamProtocolError  the reply is not valid SSE / JSON of the API
    ├── TelemetryError           GPU or server metrics could not be read
    │   ├── NvmlUnavailable      no NVML library, driver or GPU
    │   └── CounterNotSupported  this GPU does not offer that counter
    ├── RunDirError              a run directory is missing or unreadable
    │   ├── RunNotFound          the path holds no run
    │   ├── RunSchemaMismatch    written by an incompatible schema version
    │   └── RunDataError         a file in it is malformed
    ├── EngineError              the embedded engine could not start or stopped
    └── KernelProbeError         a GPU kernel probe could not run (no GPU, no torch)

Messages say what went wrong *and* the next step, in one line.
"""

from __future__ import annotations


class ServescopeError(Exception):
    """Base of every error servescope reports to the user (CLI exit code 2)."""


class ConfigError(ServescopeError):
    """A flag, option or configuration value is invalid or contradictory."""


class UnknownNameError(ConfigError):
    """A name (GPU, model, dtype, format, architecture) is not in its catalog.

    Carries the close matches so the message can suggest them.
    """

    def __init__(self, kind: str, name: str, suggestions: list[str] | tuple[str, ...] = ()) -> None:
        self.kind = kind
        self.name = name
        self.suggestions = tuple(suggestions)
        hint = f"; did you mean {', '.join(repr(s) for s in self.suggestions)}?" if self.suggestions else ""
        super().__init__(f"unknown {kind} {name!r}{hint}")


class ModelConfigError(ServescopeError):
    """A Hugging Face config.json / quantisation config cannot be read or makes no sense."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        super().__init__(f"{path}: {problem}")


class TargetError(ServescopeError):
    """The inference server under test failed; carries the URL."""

    def __init__(self, url: str, problem: str) -> None:
        self.url = url
        super().__init__(f"{url}: {problem}")


class TargetUnreachable(TargetError):
    """No connection could be made (refused, DNS, reset before any reply)."""


class TargetTimeout(TargetError):
    """The server did not answer, or stalled mid-stream, within the time limit."""


class TargetHTTPStatus(TargetError):
    """The server answered with an HTTP error status."""

    def __init__(self, url: str, status: int, body: str = "") -> None:
        self.status = status
        snippet = " ".join(body.split())[:200]
        super().__init__(url, f"HTTP {status}" + (f": {snippet}" if snippet else ""))


class StreamProtocolError(TargetError):
    """The reply is not well-formed SSE / JSON for the API spoken."""


class TelemetryError(ServescopeError):
    """GPU or server metrics could not be read."""


class NvmlUnavailable(TelemetryError):
    """NVML cannot be used here: no library, no driver, or no GPU."""


class CounterNotSupported(TelemetryError):
    """The GPU does not offer a counter (e.g. GPM metrics before Hopper)."""

    def __init__(self, gpu_index: int, counter: str, reason: str = "not supported") -> None:
        self.gpu_index = gpu_index
        self.counter = counter
        super().__init__(f"GPU {gpu_index}: counter {counter!r} {reason}")


class RunDirError(ServescopeError):
    """A run directory is missing, incompatible or malformed; carries the path."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        super().__init__(f"{path}: {problem}")


class RunNotFound(RunDirError):
    """The path holds no servescope run (no config.json)."""


class RunSchemaMismatch(RunDirError):
    """The run was written with a schema version this servescope cannot read."""


class RunDataError(RunDirError):
    """A file in the run directory is malformed."""


class EngineError(ServescopeError):
    """The embedded inference engine could not be built, started, or kept running."""


class KernelProbeError(ServescopeError):
    """A GPU kernel probe cannot run here (no GPU, no torch, unsupported dtype)."""
