"""A minimal blocking SSE/JSON client for the engine tests (the product's client lives in servescope.load)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StreamResult:
    """What one streamed request returned: HTTP status, the parsed ``data:`` events, and whether ``[DONE]`` came."""

    status: int
    events: list[dict[str, Any]]
    done_marker: bool
    body: str = ""

    @property
    def usage(self) -> dict[str, Any] | None:
        """The last ``usage`` object any event carried."""
        found = None
        for event in self.events:
            if event.get("usage"):
                found = event["usage"]
        return found

    @property
    def finish_reasons(self) -> list[str]:
        """Every non-null ``finish_reason`` in the stream."""
        return [c["finish_reason"] for e in self.events for c in e.get("choices", []) if c.get("finish_reason")]


def post_json(url: str, body: dict[str, Any], timeout_s: float = 60.0) -> tuple[int, str]:
    """POST ``body``; return (status, text) also for HTTP errors."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.status, reply.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode("utf-8", "replace")


def stream(url: str, body: dict[str, Any], timeout_s: float = 60.0) -> StreamResult:
    """POST a ``stream: true`` request and parse its SSE reply."""
    status, text = post_json(url, {**body, "stream": True}, timeout_s)
    if status != 200:
        return StreamResult(status, [], False, text)
    events: list[dict[str, Any]] = []
    done = False
    for line in text.splitlines():
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            done = True
            continue
        events.append(json.loads(payload))
    return StreamResult(status, events, done, text)
