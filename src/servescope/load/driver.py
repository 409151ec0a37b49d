"""One process's share of a sweep point: the slots or the arrival schedule, and a record per request.

The same ``drive`` runs in the sweep's own process (``--workers 1``) and in each worker
process (``load/workers.py``), so a record is built the same way whichever process sent the
request. What differs is the ``Gate`` that hands out request indices: ``LocalGate`` is a
plain counter; the workers' gate shares one counter and one measure-start/deadline across
processes, so warm-up is the first ``warm`` indices of the whole point and a duration bound
starts at the first measured send of any process, exactly as with one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from servescope.load.backends import Backend, Prompt
from servescope.load.client import StreamingClient, StreamResult
from servescope.load.records import RequestRecord
from servescope.run import now_ns

#: Loop-lag probe period: the monitor sleeps this long and records how late it wakes.
LAG_PROBE_S = 0.01
#: Closed loop: slots are started this many per event-loop iteration. Starting 2,048 at once
#: puts ~2,048 connects and request writes into ONE iteration (~100 ms on a small machine)
#: during which the first streams' chunks wait unstamped; in batches the loop polls its
#: sockets between them (docs/measurements/client-overhead.md measures the start tail).
START_BATCH = 8


@dataclass
class PointState:
    """Counters for progress display and the self-check of one point (in one process)."""

    label: str
    total: int | None
    started_ns: int
    sent: int = 0
    done: int = 0
    failed: int = 0
    tokens: int = 0
    in_flight: int = 0
    lags_ns: list[int] = field(default_factory=list)


class Stop:
    """Set by Ctrl-C (or by the parent of a worker): stops dispatching and cancels in-flight requests."""

    def __init__(self) -> None:
        self.flag = False
        self.event: asyncio.Event | None = None

    def set(self) -> None:
        self.flag = True
        if self.event is not None:
            self.event.set()


@dataclass(frozen=True, slots=True)
class Slice:
    """What one process runs of a point.

    Closed loop: ``slots`` requests in flight, indices taken from the gate as slots free up.
    Open loop (``slots is None``): ``offsets`` = (request index, ns after ``start_ns``) in
    schedule order, this process's share of the point's one precomputed absolute schedule;
    ``cap`` is its share of ``--max-concurrency``.
    """

    point: int
    first_id: int
    slots: int | None
    offsets: tuple[tuple[int, int], ...] = ()
    cap: int | None = None
    start_ns: int = 0


class Gate(Protocol):
    """Hands out request indices and their phase; shared by every slot of a point."""

    def take(self) -> tuple[int, str] | None:
        """Closed loop: the next request index and its phase, or None when the point is done."""

    def admit(self, i: int) -> str | None:
        """Open loop: the phase of scheduled request ``i``, or None when the point is done."""

    def measure_sent(self, t_ns: int) -> None:
        """A measured request went out at ``t_ns`` (the first one starts the duration bound)."""


class LocalGate:
    """The gate of a point run by one process."""

    def __init__(self, warm: int, n_measure: int | None, duration_s: float | None, stop: Stop) -> None:
        self.warm = warm
        self.n_measure = n_measure
        self.duration_s = duration_s
        self.stop = stop
        self.issued = 0  # indices handed out (closed loop) / one past the last admitted (open loop)
        self.measure_start_ns: int | None = None
        self.deadline_ns: int | None = None

    def _phase(self, i: int) -> str | None:
        if self.stop.flag:
            return None
        if i >= self.warm:
            if self.n_measure is not None and i >= self.warm + self.n_measure:
                return None
            if self.deadline_ns is not None and now_ns() >= self.deadline_ns:
                return None
        return "warmup" if i < self.warm else "measure"

    def take(self) -> tuple[int, str] | None:
        i = self.issued
        phase = self._phase(i)
        if phase is None:
            return None
        self.issued += 1
        return i, phase

    def admit(self, i: int) -> str | None:
        phase = self._phase(i)
        if phase is not None:
            self.issued = max(self.issued, i + 1)
        return phase

    def measure_sent(self, t_ns: int) -> None:
        if self.measure_start_ns is None:
            self.measure_start_ns = t_ns
            if self.duration_s is not None:
                self.deadline_ns = t_ns + int(self.duration_s * 1e9)


async def drive(sl: Slice, gate: Gate, client: StreamingClient, backend: Backend, bodies: Sequence[bytes],
                prompts: Sequence[Prompt], emit: Callable[[RequestRecord], None], state: PointState,
                stop: Stop) -> None:
    """Run ``sl`` to its end (or to Ctrl-C), passing each finished request's record to ``emit``."""
    loop = asyncio.get_running_loop()

    async def one(i: int, phase: str, scheduled: int, slot: int | None) -> None:
        prompt = prompts[i % len(prompts)]
        dec = backend.decoder()

        def on_send(t: int) -> None:
            state.sent += 1
            state.in_flight += 1
            if phase == "measure":
                gate.measure_sent(t)

        try:
            res = await client.stream(bodies[i % len(bodies)], dec, on_send)
        except asyncio.CancelledError:
            res = StreamResult(send_ns=now_ns(), end_ns=now_ns(), ok=False, error_kind="cancelled",
                               error_text="run interrupted", decoded=dec.finish())
        state.in_flight = max(0, state.in_flight - 1)
        rec = build_record(sl.first_id + i, sl.point, phase, scheduled, slot, res, prompt)
        emit(rec)
        state.done += 1
        state.failed += 0 if rec.ok else 1
        state.tokens += rec.output_tokens or 0

    if sl.slots is not None:
        await sleep_until(sl.start_ns)

        async def slot_worker() -> None:
            while True:
                nxt = gate.take()
                if nxt is None:
                    return
                scheduled = now_ns()
                await one(nxt[0], nxt[1], scheduled, None)

        workers: list[asyncio.Task[None]] = []
        for k in range(sl.slots):
            workers.append(loop.create_task(slot_worker()))
            if (k + 1) % START_BATCH == 0:
                await asyncio.sleep(0)  # let the loop stamp arrivals between batches of connects
        await wait_or_stop(workers, stop, client)
        return

    sem = asyncio.Semaphore(sl.cap) if sl.cap else None
    tasks: set[asyncio.Task[None]] = set()

    async def dispatcher() -> None:
        for i, off in sl.offsets:
            target = sl.start_ns + off
            await sleep_until(target)
            phase = gate.admit(i)
            if phase is None:
                return
            slot = None
            if sem is not None:
                await sem.acquire()
                slot = now_ns()

            async def run_one(i: int = i, ph: str = phase, sc: int = target, sl_ns: int | None = slot) -> None:
                try:
                    await one(i, ph, sc, sl_ns)
                finally:
                    if sem is not None:
                        sem.release()

            t = loop.create_task(run_one())
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    disp = loop.create_task(dispatcher())
    await wait_or_stop([disp], stop, client)
    if tasks:
        await wait_or_stop(list(tasks), stop, client)


async def sleep_until(target_ns: int) -> None:
    """Sleep until ``now_ns() >= target_ns``, never earlier.

    uvloop's timers have millisecond resolution on a cached loop clock, so one
    ``asyncio.sleep`` can wake up to ~1 ms early: a request would go out before its
    scheduled time (negative send lateness). Sleep again for what is left.
    """
    while (delay_ns := target_ns - now_ns()) > 0:
        await asyncio.sleep(delay_ns / 1e9)


async def wait_or_stop(tasks: list[asyncio.Task[None]], stop: Stop, client: StreamingClient) -> None:
    """Wait for ``tasks``; on Ctrl-C, fail in-flight requests as cancelled (keeping their data) and finish."""
    assert stop.event is not None
    stopper = asyncio.ensure_future(stop.event.wait())
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending | {stopper}, return_when=asyncio.FIRST_COMPLETED)
            if stopper in done:
                pending.discard(stopper)
                client.cancel_all()
                if pending:
                    await asyncio.wait(pending, timeout=10)
                break
            pending.discard(stopper)
    finally:
        stopper.cancel()


async def lag_monitor(state: PointState) -> None:
    """Event-loop lag: how late a 10 ms sleep wakes up. A busy loop delays every timestamp by as much."""
    period_ns = int(LAG_PROBE_S * 1e9)
    while True:
        t0 = now_ns()
        await asyncio.sleep(LAG_PROBE_S)
        state.lags_ns.append(max(0, now_ns() - t0 - period_ns))


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """Collect once, then keep the cycle collector off everything that already exists while a point runs.

    A full (generation 2) collection walks every live object: with a tokenizer, prompts and
    request bytes loaded it paused the loop for ~30 ms mid-point, which showed up as the max
    client-added delay at 1,024+ streams (docs/measurements/client-overhead.md). Frozen objects
    are not scanned; new ones still are. Restored (``gc.unfreeze``) when the point ends.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def lag_stats(lags_ns: list[int]) -> dict[str, Any]:
    """Loop-lag percentiles (ms) of pooled probe samples (nearest rank, as the 1-process self-check always did)."""
    lags = sorted(lags_ns)

    def pct(p: float) -> float | None:
        return lags[min(len(lags) - 1, int(p / 100 * len(lags)))] / 1e6 if lags else None

    return {"loop_lag_p50_ms": pct(50), "loop_lag_p99_ms": pct(99),
            "loop_lag_max_ms": lags[-1] / 1e6 if lags else None, "loop_lag_samples": len(lags)}


def client_check(state: PointState, cpu_s: float, wall_s: float) -> dict[str, Any]:
    """The self-check of a point run in one process."""
    return {
        **lag_stats(state.lags_ns),
        "cpu_s": cpu_s,
        "wall_s": wall_s,
        "cpu_pct": 100.0 * cpu_s / wall_s if wall_s > 0 else None,
        "processes": 1,
    }


def split_even(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` integers that differ by at most one (larger first)."""
    base, rest = divmod(total, parts)
    return [base + (1 if k < rest else 0) for k in range(parts)]


def build_record(rid: int, point: int, phase: str, scheduled: int, slot: int | None, res: StreamResult,
                 prompt: Prompt) -> RequestRecord:
    dec = res.decoded
    chunk_ns = tuple(dec.chunk_ns) if dec else ()
    return RequestRecord(
        request_id=rid,
        point=point,
        phase=phase,
        scheduled_ns=scheduled,
        send_ns=res.send_ns,
        end_ns=res.end_ns,
        first_token_ns=chunk_ns[0] if chunk_ns else None,
        chunk_ns=chunk_ns,
        chunk_tokens=tuple(dec.chunk_tokens) if dec else (),
        prompt_tokens=(dec.prompt_tokens if dec and dec.prompt_tokens is not None else prompt.prompt_tokens),
        output_tokens=dec.output_tokens if dec else None,
        output_tokens_source=dec.output_tokens_source if dec else "none",
        requested_output_tokens=prompt.output_len,
        ok=res.ok,
        error_kind=res.error_kind,
        error_text=res.error_text,
        http_status=res.status,
        finish_reason=dec.finish_reason if dec else None,
        extra={"prompt_tokens_source": "usage" if dec and dec.prompt_tokens is not None else "client"},
        slot_ns=slot,
        chunk_tokens_source=dec.chunk_tokens_source if dec else "none",
        chunk_send_ns=tuple(dec.stamps_ns) if dec else (),
    )
