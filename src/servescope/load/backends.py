"""API dialects: how to ask for a streamed completion, and how to read the events back.

A backend only builds request bodies and decodes SSE ``data`` strings; it never does
I/O and never reads a clock (the streaming client stamps arrivals and hands them in).
So the same decoder is tested on literal bytes recorded from real servers, and the
HTTP loop never needs to know which API it speaks (guidellm's split between
``request_handlers.py`` and ``http.py``).

Token counting, in order of trust (``records.TOKEN_SOURCES``):
- ``usage``: the server's own ``usage.completion_tokens`` (OpenAI) or
  ``meta_info.completion_tokens`` (sglang) at the end of the stream;
- ``chunk_usage``: the last running count seen (``continuous_usage_stats``) when no
  final usage came;
- ``chunks``: no count from the server at all, one token per content chunk: FLAGGED,
  because servers that hold back partial characters or batch tokens send fewer chunks
  than tokens;
- never the requested length.

Per-chunk token deltas (for chunk-aware ITL) come from running counts when every
content chunk carries one (``chunk_tokens_source="usage"``), else one per non-empty
chunk (``"count"``), which the summary flags.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

#: The backends servescope speaks, by CLI name.
BACKENDS = ("openai", "openai-chat", "sglang")

#: Field the selftest server adds to every chunk: its send time on CLOCK_MONOTONIC (ns).
STAMP_FIELD = "servescope_send_ns"


class StreamDecodeError(ValueError):
    """An event is not valid for the API (bad JSON, wrong shape). Kind ``malformed``."""


class StreamServerError(ValueError):
    """The server reported an error inside a 200 stream. Kind ``stream_error``."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prepared prompt. ``token_ids`` is set when the API takes IDs (sglang native)."""

    text: str
    output_len: int
    prompt_tokens: int | None = None  # our own count when a tokenizer was used
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """What to ask of the server beyond prompt and length; negotiated once per run.

    The ``include_usage`` / ``continuous_usage`` / ``ignore_eos`` / ``min_tokens`` flags are
    dropped one by one when the server rejects them (HTTP 400/422); ``notes`` says which.
    """

    model: str
    include_usage: bool = True
    continuous_usage: bool = True
    ignore_eos: bool = True
    min_tokens: bool = False
    temperature: float | None = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    def without(self, name: str) -> RequestOptions:
        if name == "include_usage":
            return replace(self, include_usage=False, continuous_usage=False)
        if name == "temperature":
            return replace(self, temperature=None)
        return replace(self, **{name: False})


#: Options that may be dropped when a server rejects them, in the order we give them up.
DROPPABLE = ("continuous_usage", "include_usage", "min_tokens", "ignore_eos", "temperature")

#: Words in a 4xx body that point at the option responsible.
OPTION_HINTS = {
    "continuous_usage": ("continuous_usage_stats",),
    "include_usage": ("stream_options", "include_usage"),
    "min_tokens": ("min_tokens", "min_new_tokens"),
    "ignore_eos": ("ignore_eos",),
    "temperature": ("temperature",),
}


@dataclass(slots=True)
class DecodedStream:
    """What a finished stream said, apart from arrival times of non-content events."""

    chunk_ns: list[int]
    chunk_tokens: list[int]
    chunk_tokens_source: str  # "usage" | "count" | "none"
    output_tokens: int | None
    output_tokens_source: str
    prompt_tokens: int | None
    finish_reason: str | None
    done_seen: bool
    stamps_ns: list[int]  # selftest server send stamps of the content chunks (else empty)
    events: int


class StreamDecoder:
    """Accumulates one response's events; ``finish()`` resolves token counts.

    Subclasses implement ``_parse(obj) -> (text, cum_tokens, final_usage, prompt_tokens,
    finish_reason)``. ``add`` is called on the client's hot path, so it does the least work
    that lets ``finish`` decide: one ``json.loads`` and a few dict lookups.
    """

    __slots__ = ("_cum", "_done", "_events", "_final_usage", "_finish", "_prompt", "_stamps", "_t", "_text")

    def __init__(self) -> None:
        self._t: list[int] = []  # arrival of each choice-bearing event
        self._text: list[bool] = []  # whether it carried non-empty text
        self._cum: list[int | None] = []  # running completion-token count, if sent
        self._stamps: list[int | None] = []
        self._final_usage: int | None = None
        self._prompt: int | None = None
        self._finish: str | None = None
        self._done = False
        self._events = 0

    def add(self, data: str, arrival_ns: int) -> None:
        """Take one SSE ``data`` string that arrived at ``arrival_ns``."""
        self._events += 1
        if data == "[DONE]":
            self._done = True
            return
        try:
            obj = json.loads(data)
        except ValueError as err:
            raise StreamDecodeError(f"event is not JSON: {data[:120]!r}") from err
        if not isinstance(obj, dict):
            raise StreamDecodeError(f"event is not a JSON object: {data[:120]!r}")
        if "error" in obj or obj.get("object") == "error":
            err = obj.get("error", obj)
            msg = err.get("message", err) if isinstance(err, dict) else err
            raise StreamServerError(f"server error in stream: {str(msg)[:300]}")
        self._parse(obj, arrival_ns)

    def _parse(self, obj: dict[str, Any], arrival_ns: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _chunk(self, arrival_ns: int, has_text: bool, cum: int | None, stamp: Any) -> None:
        self._t.append(arrival_ns)
        self._text.append(has_text)
        self._cum.append(cum)
        self._stamps.append(stamp if isinstance(stamp, int) else None)

    def finish(self) -> DecodedStream:
        """Resolve per-chunk token deltas and the output count from what was seen."""
        chunk_ns: list[int] = []
        chunk_tokens: list[int] = []
        stamps: list[int] = []
        has_cum = bool(self._t) and all(c is not None for c in self._cum)
        if has_cum:
            prev = 0
            for t, c, s in zip(self._t, self._cum, self._stamps, strict=True):
                delta = int(c) - prev  # type: ignore[arg-type]
                if delta > 0:
                    chunk_ns.append(t)
                    chunk_tokens.append(delta)
                    if s is not None:
                        stamps.append(s)
                    prev = int(c)  # type: ignore[arg-type]
            source = "usage"
        else:
            for t, txt, s in zip(self._t, self._text, self._stamps, strict=True):
                if txt:
                    chunk_ns.append(t)
                    chunk_tokens.append(1)
                    if s is not None:
                        stamps.append(s)
            source = "count" if chunk_ns else "none"
        if self._final_usage is not None:
            out, out_src = self._final_usage, "usage"
        elif has_cum:
            out, out_src = sum(chunk_tokens), "chunk_usage"
        elif chunk_ns:
            out, out_src = len(chunk_ns), "chunks"
        else:
            out, out_src = 0, "none"
        return DecodedStream(
            chunk_ns=chunk_ns,
            chunk_tokens=chunk_tokens,
            chunk_tokens_source=source,
            output_tokens=out,
            output_tokens_source=out_src,
            prompt_tokens=self._prompt,
            finish_reason=self._finish,
            done_seen=self._done,
            stamps_ns=stamps if len(stamps) == len(chunk_ns) else [],
            events=self._events,
        )

    @property
    def finished(self) -> bool:
        """The stream said it is over ([DONE] or a finish_reason)."""
        return self._done or self._finish is not None


class OpenAICompletionDecoder(StreamDecoder):
    """``/v1/completions`` chunks: ``choices[0].text``, ``usage`` (running or final)."""

    __slots__ = ()
    _content_key = "text"

    def _parse(self, obj: dict[str, Any], arrival_ns: int) -> None:
        usage = obj.get("usage")
        cum = None
        if isinstance(usage, dict):
            ct = usage.get("completion_tokens")
            if isinstance(ct, int):
                cum = ct
            pt = usage.get("prompt_tokens")
            if isinstance(pt, int):
                self._prompt = pt
        choices = obj.get("choices")
        if choices:
            if not isinstance(choices, list) or not isinstance(choices[0], dict):
                raise StreamDecodeError(f"'choices' is not a list of objects: {str(choices)[:120]!r}")
            ch = choices[0]
            text = self._text_of(ch)
            fr = ch.get("finish_reason")
            if fr:
                self._finish = str(fr)
                if cum is not None:
                    self._final_usage = cum
            self._chunk(arrival_ns, bool(text), cum, obj.get(STAMP_FIELD))
        elif cum is not None:
            # A usage-only chunk (OpenAI include_usage): the server's final count.
            self._final_usage = cum
        elif choices is None and usage is None:
            raise StreamDecodeError(f"event has neither 'choices' nor 'usage': {str(obj)[:120]!r}")

    @staticmethod
    def _text_of(choice: dict[str, Any]) -> str:
        text = choice.get("text")
        return text if isinstance(text, str) else ""


class OpenAIChatDecoder(OpenAICompletionDecoder):
    """``/v1/chat/completions`` chunks: ``choices[0].delta.content`` (or reasoning content).

    A role-only first delta carries no token and does not count as the first token
    (vLLM counts it: vllm#15106); the difference is documented in docs/metrics.md.
    """

    __slots__ = ()

    @staticmethod
    def _text_of(choice: dict[str, Any]) -> str:
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return ""
        for key in ("content", "reasoning_content", "reasoning"):
            v = delta.get(key)
            if isinstance(v, str) and v:
                return v
        return ""


class SglangGenerateDecoder(StreamDecoder):
    """sglang native ``/generate``: cumulative ``text`` and ``meta_info`` counts in each event."""

    __slots__ = ()

    def _parse(self, obj: dict[str, Any], arrival_ns: int) -> None:
        meta = obj.get("meta_info")
        if not isinstance(meta, dict):
            raise StreamDecodeError(f"event has no 'meta_info': {str(obj)[:120]!r}")
        ct = meta.get("completion_tokens")
        pt = meta.get("prompt_tokens")
        if isinstance(pt, int):
            self._prompt = pt
        cum = ct if isinstance(ct, int) else None
        fr = meta.get("finish_reason")
        if fr:
            self._finish = str(fr.get("type", fr)) if isinstance(fr, dict) else str(fr)
            if cum is not None:
                self._final_usage = cum
        self._chunk(arrival_ns, bool(obj.get("text")), cum, obj.get(STAMP_FIELD))


@dataclass(frozen=True, slots=True)
class Backend:
    """An API dialect: its path, how to build a body, and its decoder."""

    name: str
    path: str

    def body(self, prompt: Prompt, opts: RequestOptions) -> dict[str, Any]:
        """The JSON body asking for a streamed completion of ``prompt``."""
        if self.name == "sglang":
            sp: dict[str, Any] = {"max_new_tokens": prompt.output_len}
            if opts.temperature is not None:
                sp["temperature"] = opts.temperature
            if opts.ignore_eos:
                sp["ignore_eos"] = True
            if opts.min_tokens:
                sp["min_new_tokens"] = prompt.output_len
            body: dict[str, Any] = {"sampling_params": sp, "stream": True}
            if prompt.token_ids is not None:
                body["input_ids"] = list(prompt.token_ids)
            else:
                body["text"] = prompt.text
        else:
            body = {"model": opts.model, "max_tokens": prompt.output_len, "stream": True}
            if self.name == "openai-chat":
                body["messages"] = [{"role": "user", "content": prompt.text}]
            else:
                body["prompt"] = prompt.text
            if opts.temperature is not None:
                body["temperature"] = opts.temperature
            if opts.include_usage:
                so: dict[str, Any] = {"include_usage": True}
                if opts.continuous_usage:
                    so["continuous_usage_stats"] = True
                body["stream_options"] = so
            if opts.ignore_eos:
                body["ignore_eos"] = True
            if opts.min_tokens:
                body["min_tokens"] = prompt.output_len
        body.update(opts.extra_body)
        return body

    def decoder(self) -> StreamDecoder:
        if self.name == "openai":
            return OpenAICompletionDecoder()
        if self.name == "openai-chat":
            return OpenAIChatDecoder()
        return SglangGenerateDecoder()


def get_backend(name: str) -> Backend:
    """The backend for a CLI name; ``ValueError`` for an unknown one (the caller maps it)."""
    paths = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions", "sglang": "/generate"}
    if name not in paths:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return Backend(name=name, path=paths[name])
