"""A pure Server-Sent Events parser: fed bytes, returns events. No I/O, no clock.

Why a parser of our own instead of splitting on ``b"\\n\\n"`` like the peer benchmark
clients: servers differ in the small things (CRLF line ends, ``data:`` without the
space, multi-line ``data`` fields, comment pings, an event split across two TCP reads,
a stream that ends without the final blank line). Getting any of these wrong silently
merges or drops token chunks, which corrupts ITL. The rules follow the WHATWG HTML
spec, section "9.2.6 Interpreting an event stream":

- lines end with CRLF, LF or CR;
- a line starting with ``:`` is a comment (servers send them as keep-alive pings);
- ``field:value`` with one optional space after the colon stripped; a line without a
  colon is a field with an empty value;
- several ``data`` lines of one event are joined with ``\\n``;
- a blank line dispatches the event; an event with no ``data`` is not dispatched.

The parser is fed raw bytes in whatever pieces the socket delivered and keeps the
incomplete tail for the next feed. ``close()`` flushes an event that the server never
terminated with a blank line (the spec discards it; we return it flagged, because a
server that just closes the connection after its last ``data:`` line still sent it).
"""

from __future__ import annotations

from typing import NamedTuple


class SseEvent(NamedTuple):
    """One dispatched event. ``end_offset`` is the stream byte offset just past the event.

    The offset lets the client map an event back to the socket read that completed it,
    and so to that read's arrival time, without timestamping inside the parser. (A
    NamedTuple, not a frozen dataclass: one is built per token chunk on the hot path.)
    """

    data: str
    event: str = ""
    id: str | None = None
    end_offset: int = 0
    unterminated: bool = False  # the stream ended before the blank line


class SseParser:
    """Incremental SSE parser. ``feed(bytes) -> list[SseEvent]``; ``close() -> list[SseEvent]``."""

    __slots__ = ("_buf", "_consumed", "_data", "_event", "_has_data", "_id", "_pending_cr")

    def __init__(self) -> None:
        self._buf = b""
        self._consumed = 0  # stream offset of _buf[0]
        self._data: list[str] = []
        self._has_data = False
        self._event = ""
        self._id: str | None = None
        self._pending_cr = False  # the previous feed ended on CR: a following LF belongs to it

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """Consume ``chunk`` and return every event it completed, in order."""
        if not chunk:
            return []
        if (not self._buf and not self._pending_cr and not self._has_data and not self._event
                and chunk.endswith(b"\n\n") and b"\r" not in chunk):
            fast = self._feed_fast(chunk)
            if fast is not None:
                return fast
        buf = self._buf + chunk if self._buf else chunk
        base = self._consumed
        pos = 0
        if self._pending_cr:
            self._pending_cr = False
            if buf[:1] == b"\n":
                pos = 1
        out: list[SseEvent] = []
        n = len(buf)
        while pos < n:
            lf = buf.find(b"\n", pos)
            cr = buf.find(b"\r", pos, lf if lf >= 0 else n)
            if cr >= 0:
                end, nxt = cr, cr + 1
                if nxt < n and buf[nxt : nxt + 1] == b"\n":
                    nxt += 1
                elif nxt == n:
                    self._pending_cr = True
            elif lf >= 0:
                end, nxt = lf, lf + 1
            else:
                break  # incomplete line: keep for the next feed
            self._line(buf[pos:end], base + nxt, out)
            pos = nxt
        self._buf = buf[pos:]
        self._consumed = base + pos
        return out

    def _feed_fast(self, chunk: bytes) -> list[SseEvent] | None:
        """The common case: whole ``data: ...`` events with LF endings. None = use the general path."""
        blocks = chunk[:-2].split(b"\n\n")
        out = []
        off = self._consumed
        for b in blocks:
            if not b.startswith(b"data: ") or b"\n" in b:
                return None
            off += len(b) + 2
            out.append(SseEvent(b[6:].decode("utf-8", errors="replace"), "", self._id, off))
        self._consumed = off
        return out

    def close(self) -> list[SseEvent]:
        """The stream ended: return an event left without its terminating blank line, flagged."""
        out: list[SseEvent] = []
        if self._buf:
            self._line(self._buf, self._consumed + len(self._buf), out)
            self._consumed += len(self._buf)
            self._buf = b""
        if self._has_data:
            out.append(self._dispatch(self._consumed, unterminated=True))
        return out

    def _line(self, raw: bytes, end_offset: int, out: list[SseEvent]) -> None:
        if not raw:
            if self._has_data:
                out.append(self._dispatch(end_offset))
            else:
                self._event = ""
            return
        line = raw.decode("utf-8", errors="replace")
        if line[0] == ":":
            return
        colon = line.find(":")
        if colon < 0:
            name, value = line, ""
        else:
            name, value = line[:colon], line[colon + 1 :]
            if value[:1] == " ":
                value = value[1:]
        if name == "data":
            self._data.append(value)
            self._has_data = True
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        # "retry" and unknown fields are ignored, as the spec says.

    def _dispatch(self, end_offset: int, unterminated: bool = False) -> SseEvent:
        ev = SseEvent(
            data="\n".join(self._data),
            event=self._event,
            id=self._id,
            end_offset=end_offset,
            unterminated=unterminated,
        )
        self._data = []
        self._has_data = False
        self._event = ""
        return ev
