"""Per-request and per-sweep-point records: the raw data every latency metric derives from.

Timestamps first, metrics derived (as guidellm's ``RequestTimings``): a record keeps the
whole lifecycle of one request on the run clock (``servescope.run.now_ns``), and TTFT,
TPOT, ITL are computed from it later (``load/metrics.py``), so a formula can be fixed
and every past run re-summarised. Records are frozen dataclasses; JSON only at the edge.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

#: How the output token count of a request was obtained. Only "usage" is the server's
#: own count; the others are flagged in summaries, never silently trusted.
TOKEN_SOURCES = ("usage", "chunk_usage", "chunks", "none")

#: Failure kinds, so a summary can count failures by cause instead of dropping them.
ERROR_KINDS = (
    "unreachable",  # connection refused / reset before a reply
    "http_status",  # 4xx / 5xx
    "timeout",  # no reply or a stall mid-stream past the per-request limit
    "disconnect",  # connection closed mid-stream before the end of the reply
    "malformed",  # SSE / JSON that the API does not allow
    "cancelled",  # the run was interrupted while the request was in flight
    "client",  # anything else that went wrong on our side
    "stream_error",  # the server reported an error object inside a 200 stream
)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request, from its scheduled time to its last byte, on the run clock (ns).

    ``chunk_ns[i]`` is the arrival of the i-th content-bearing chunk and
    ``chunk_tokens[i]`` the number of output tokens it carried (from the server's
    running usage when offered, else 1 per chunk, flagged by ``output_tokens_source``).
    ``scheduled_ns`` is when the load pattern wanted the request sent; ``send_ns`` when
    it actually went out: the difference is client-side queueing / send lateness.
    """

    request_id: int
    point: int  # index of the sweep point this request belongs to
    phase: str  # "warmup" | "measure"
    scheduled_ns: int
    send_ns: int
    end_ns: int
    first_token_ns: int | None = None
    chunk_ns: tuple[int, ...] = ()
    chunk_tokens: tuple[int, ...] = ()
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    output_tokens_source: str = "none"
    requested_output_tokens: int | None = None
    ok: bool = True
    error_kind: str | None = None
    error_text: str | None = None
    http_status: int | None = None
    finish_reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # Added by the load generator (issue 3); older readers ignore them.
    #: when the request got its concurrency slot (open loop with a cap); None = scheduled_ns.
    #: client queue = slot_ns - scheduled_ns; send lateness = send_ns - slot_ns.
    slot_ns: int | None = None
    #: how ``chunk_tokens`` was obtained: "usage" (running server counts), "count" (1 per
    #: non-empty chunk: flagged), "none".
    chunk_tokens_source: str = "none"
    #: the server's send stamp of each content chunk when it offers one (the selftest
    #: server does): client-added delay = chunk_ns[i] - chunk_send_ns[i].
    chunk_send_ns: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        # Not dataclasses.asdict: it deep-copies recursively (~300 us a record), and this runs on
        # the client's event loop once per finished request.
        d = {name: getattr(self, name) for name in _REQUEST_FIELDS}
        d["chunk_ns"] = list(self.chunk_ns)
        d["chunk_tokens"] = list(self.chunk_tokens)
        d["chunk_send_ns"] = list(self.chunk_send_ns)
        d["extra"] = dict(self.extra)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        kwargs["chunk_ns"] = tuple(kwargs.get("chunk_ns") or ())
        kwargs["chunk_tokens"] = tuple(kwargs.get("chunk_tokens") or ())
        kwargs["chunk_send_ns"] = tuple(kwargs.get("chunk_send_ns") or ())
        return cls(**kwargs)


_REQUEST_FIELDS = tuple(f.name for f in fields(RequestRecord))


@dataclass(frozen=True, slots=True)
class PointRecord:
    """One sweep point (a concurrency level or a request rate), written when it ends.

    ``measure_start_ns`` is when the first measured (non-warm-up) request was sent;
    ``end_ns`` when the last one finished. Telemetry windows per point use these bounds.
    """

    point: int
    label: str  # e.g. "c=256" or "rate=8.0"
    concurrency: int | None
    request_rate: float | None
    start_ns: int  # warm-up start
    measure_start_ns: int
    end_ns: int
    num_requests: int
    num_warmup: int
    interrupted: bool = False
    client: dict[str, Any] = field(default_factory=dict)  # self-check: loop lag, CPU, lateness
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PointRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})
