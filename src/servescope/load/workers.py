"""Several client processes for one sweep point (``--workers N``), for when one process cannot keep up.

One Python process reads roughly 60-180k chunk events per CPU-second
(docs/measurements/client-overhead.md); past that its event loop lags and every timestamp
with it. ``WorkerPool`` spreads a point over N processes, each with its own event loop,
connection pool and ``StreamingClient``, running ``driver.drive`` on its ``Slice``:

- closed loop: the concurrency is split into N slot sets (differing by at most one); all
  processes take request indices from ONE shared counter, so the warm-up is the first
  ``warm`` indices of the point and ids are unique and contiguous, as with one process;
- open loop: the point's one precomputed absolute schedule is dealt round-robin (request i
  to process i mod N) and every process aims at ``t0 + offset`` with the same ``t0``, so the
  union of the slices is exactly the schedule; ``--max-concurrency`` is split like slots
  (a request may wait for its own process's slot while another process has one free);
- a duration bound starts at the first measured send of any process (shared deadline).

Timestamps stay ``time.monotonic_ns()`` (CLOCK_MONOTONIC is one clock for every process of
the machine). Finished records go to the parent over a pipe in small batches (at most
``BATCH_RECORDS`` or ``BATCH_S`` old), and the parent alone appends ``requests.jsonl``, one
flushed line each: a crash of the parent loses nothing received; a worker killed outright
loses at most its unsent batch. Workers ignore SIGINT (a terminal's Ctrl-C reaches the whole
process group): the parent tells them to stop, they fail in-flight requests as ``cancelled``
(with the chunks they had), send every record and report their self-check.

Processes are started with ``spawn`` (the parent may hold threads: telemetry, executors), once
per sweep, and reused by every point that needs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from multiprocessing import get_context
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from servescope.errors import ConfigError
from servescope.load.backends import Prompt, get_backend
from servescope.load.client import Endpoint, StreamingClient, new_event_loop
from servescope.load.driver import LocalGate, PointState, Slice, Stop, drive, gc_frozen, lag_monitor, lag_stats
from servescope.load.records import RequestRecord
from servescope.run import now_ns

log = logging.getLogger(__name__)

#: ``--workers auto``: streams one process is given before a second one is started. From
#: docs/measurements/client-overhead.md (benchmarks/client_overhead.py): one process read 2,048
#: streams (12,800 events/s) at ~0.2 of a core with its median added delay under 0.2 ms; more
#: streams were not measured, so past that a second process is the cautious choice.
STREAMS_PER_WORKER = 2048
#: A worker sends its finished records when this many are waiting, or when the oldest is this old.
BATCH_RECORDS = 32
BATCH_S = 0.01
#: Progress counters from each worker this often (for the live display only).
HEARTBEAT_S = 0.5
#: Lead time between telling the workers "go" and the point's t0, so all start on the same ns.
GO_LEAD_NS = 20_000_000
#: How long a worker may take to start (import, first message) before the point fails.
START_TIMEOUT_S = 60.0
#: After a stop, how long to wait for workers to hand over their last records.
STOP_TIMEOUT_S = 30.0


def resolve_workers(workers: int | str, concurrency: int | None, cpu_count: int | None = None) -> int:
    """Processes for one point: ``workers`` (or ``auto``), never more than its concurrency / cap.

    ``auto`` is one process per ``STREAMS_PER_WORKER`` streams, at most one per CPU; an open
    loop without a cap has no stream count to go by and runs in one process.
    """
    if workers == "auto":
        if not concurrency:
            return 1
        cpus = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
        return max(1, min(cpus, math.ceil(concurrency / STREAMS_PER_WORKER)))
    n = int(workers)
    return max(1, min(n, concurrency)) if concurrency else n


def parse_workers(value: int | str) -> int | str:
    """``--workers`` as given: an integer >= 1 or ``auto``."""
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        try:
            value = int(value)
        except ValueError as err:
            raise ConfigError(f"--workers {value!r}: give an integer >= 1 or auto") from err
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 256:
        raise ConfigError(f"--workers {value!r}: give an integer from 1 to 256, or auto")
    return value


def closed_slices(point: int, first_id: int, concurrency: int, n: int) -> list[Slice]:
    """A closed-loop point's slot sets, one per process."""
    base, rest = divmod(concurrency, n)
    return [Slice(point, first_id, slots=base + (1 if k < rest else 0)) for k in range(n)]


def open_slices(point: int, first_id: int, offsets: Sequence[int], cap: int | None, n: int) -> list[Slice]:
    """A schedule dealt round-robin: process k gets requests k, k + n, ...; the cap is split like slots."""
    caps: list[int | None] = [None] * n
    if cap:
        base, rest = divmod(cap, n)
        caps = [base + (1 if k < rest else 0) for k in range(n)]
    indexed = list(enumerate(offsets))
    return [Slice(point, first_id, slots=None, offsets=tuple(indexed[k::n]), cap=caps[k]) for k in range(n)]


@dataclass(frozen=True)
class PointPlan:
    """What every worker needs for a point besides its slice (sent once, pickled once)."""

    bodies: tuple[bytes, ...]
    prompts: tuple[Prompt, ...]
    warm: int
    n_measure: int | None
    duration_s: float | None


@dataclass
class PointOutcome:
    """What the parent learns from a point run by workers."""

    issued: int  # one past the highest request index handed out
    measure_start_ns: int | None
    start_ns: int
    client: dict[str, Any]


class _SharedGate(LocalGate):
    """``LocalGate`` over values shared by every worker of the pool (one lock for all)."""

    def __init__(self, shared: _Shared, plan: PointPlan, stop: Stop) -> None:
        super().__init__(plan.warm, plan.n_measure, plan.duration_s, stop)
        self.shared = shared
        self._seen_measure = False

    def _deadline(self) -> int | None:
        d = self.shared.deadline_ns.value
        return d or None

    def take(self) -> tuple[int, str] | None:
        if self.stop.flag:
            return None
        with self.shared.lock:
            i = self.shared.issued.value
            self.deadline_ns = self._deadline()
            phase = self._phase(i)
            if phase is None:
                return None
            self.shared.issued.value = i + 1
        return i, phase

    def admit(self, i: int) -> str | None:
        self.deadline_ns = self._deadline()
        phase = self._phase(i)
        if phase is not None:
            with self.shared.lock:
                self.shared.issued.value = max(self.shared.issued.value, i + 1)
        return phase

    def measure_sent(self, t_ns: int) -> None:
        if self._seen_measure:
            return
        self._seen_measure = True
        with self.shared.lock:  # the earliest first send of any process (they may take the lock out of order)
            first = self.shared.measure_start_ns.value
            if not first or t_ns < first:
                self.shared.measure_start_ns.value = t_ns
                if self.duration_s is not None:
                    self.shared.deadline_ns.value = t_ns + int(self.duration_s * 1e9)


@dataclass
class _Shared:
    """Counters every worker of a pool sees (inherited at process start, not pickled through pipes)."""

    issued: Any
    measure_start_ns: Any
    deadline_ns: Any
    lock: Any

    def reset(self) -> None:
        with self.lock:
            self.issued.value = 0
            self.measure_start_ns.value = 0
            self.deadline_ns.value = 0


@dataclass
class _Worker:
    process: Any
    conn: Connection


class WorkerPool:
    """Worker processes for one sweep, started on first need. Use as a context manager (stops them all)."""

    def __init__(self, url: str, backend: str, timeout_s: float) -> None:
        self._ctx = get_context("spawn")
        self._url = url
        self._backend = backend
        self._timeout_s = timeout_s
        self._shared = _Shared(self._ctx.RawValue("q", 0), self._ctx.RawValue("q", 0), self._ctx.RawValue("q", 0),
                               self._ctx.Lock())
        self._workers: list[_Worker] = []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ensure(self, n: int) -> None:
        while len(self._workers) < n:
            k = len(self._workers)
            parent_conn, child_conn = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(target=worker_main, name=f"servescope-worker-{k}", daemon=True,
                                     args=(k, child_conn, self._shared, self._url, self._backend, self._timeout_s))
            # Block SIGINT while starting: the child inherits the mask and ignores SIGINT before
            # unblocking it, so a terminal's Ctrl-C never kills a worker mid-import.
            main = hasattr(signal, "pthread_sigmask")
            old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if main else None
            try:
                proc.start()
            finally:
                if old is not None:
                    signal.pthread_sigmask(signal.SIG_SETMASK, old)
            child_conn.close()
            self._workers.append(_Worker(proc, parent_conn))

    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def close(self) -> None:
        """Tell every worker to exit; terminate any that does not within a few seconds.

        "stop" first: a worker still running a point (the parent failed mid-point) cancels its
        requests at once instead of finishing the point before it reads "exit".
        """
        for w in self._workers:
            with contextlib.suppress(OSError, ValueError):
                w.conn.send(("stop",))
                w.conn.send(("exit",))
        for w in self._workers:
            w.process.join(5)
            if w.process.is_alive():
                log.warning("worker %s did not exit; terminating it", w.process.pid)
                w.process.terminate()
                w.process.join(5)
            with contextlib.suppress(OSError):
                w.conn.close()
        self._workers.clear()

    async def run_point(self, slices: list[Slice], plan: PointPlan, emit: Callable[[dict[str, Any]], None],
                        state: PointState, stop: Stop) -> PointOutcome:
        """Run one point on ``len(slices)`` workers; ``emit`` gets every record (as a dict) as it arrives."""
        n = len(slices)
        self._ensure(n)
        self._shared.reset()
        active = self._workers[:n]
        loop = asyncio.get_running_loop()
        ready: set[int] = set()
        done: dict[int, dict[str, Any] | None] = {}
        counters: dict[int, tuple[int, int, int, int, int]] = {}
        all_ready: asyncio.Future[None] = loop.create_future()
        all_done: asyncio.Future[None] = loop.create_future()

        def settle() -> None:
            if len(ready) + sum(1 for k in done if k not in ready) >= n and not all_ready.done():
                all_ready.set_result(None)
            if len(done) >= n and not all_done.done():
                all_done.set_result(None)

        def add_counts() -> None:
            vals = list(counters.values())
            state.sent, state.done, state.failed, state.tokens, state.in_flight = (sum(c[j] for c in vals)
                                                                                  for j in range(5))

        def on_readable(k: int) -> None:
            conn = active[k].conn
            try:
                while conn.poll():
                    msg = conn.recv()
                    kind = msg[0]
                    if kind == "recs":
                        for rec in msg[1]:
                            emit(rec)
                        counters[k] = msg[2]
                        add_counts()
                    elif kind == "prog":
                        counters[k] = msg[1]
                        add_counts()
                    elif kind == "ready":
                        ready.add(k)
                    elif kind == "done":
                        done[k] = msg[1]
                    settle()
            except (EOFError, OSError) as err:
                loop.remove_reader(conn.fileno())
                if k not in done:
                    log.warning("worker %d (pid %s) is gone (%s): its unsent records are lost", k,
                                active[k].process.pid, err)
                    done[k] = None
                settle()

        for k, w in enumerate(active):
            _add_blocking_reader(loop, w.conn, on_readable, k)
        stopper = asyncio.ensure_future(_wait_stop(stop))
        t0 = 0
        try:
            blob = ForkingPickler.dumps(("plan", plan))
            for k, w in enumerate(active):
                w.conn.send_bytes(blob)
                w.conn.send(("slice", slices[k]))
            await asyncio.wait([all_ready, stopper], timeout=START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
            if not all_ready.done() and not stop.flag:
                raise ConfigError(f"{n - len(ready)} of {n} worker processes did not start within "
                                  f"{START_TIMEOUT_S:g} s; run with --workers 1")
            if stop.flag:
                self._send_all(active, ("stop",))
            else:
                t0 = now_ns() + GO_LEAD_NS
                self._send_all(active, ("go", t0))
                await asyncio.wait([all_done, stopper], return_when=asyncio.FIRST_COMPLETED)
                if not all_done.done():
                    self._send_all(active, ("stop",))
            await asyncio.wait([all_done], timeout=STOP_TIMEOUT_S)
            if not all_done.done():
                log.warning("workers did not finish within %g s of the stop; their last records may be lost",
                            STOP_TIMEOUT_S)
        finally:
            stopper.cancel()
            for w in active:
                with contextlib.suppress(OSError, ValueError):
                    loop.remove_reader(w.conn.fileno())
        stats = [done.get(k) for k in range(n)]
        start = t0 or now_ns()
        return PointOutcome(issued=self._shared.issued.value,
                            measure_start_ns=self._shared.measure_start_ns.value or None, start_ns=start,
                            client=merge_client_checks(stats, [w.process.pid for w in active]))

    @staticmethod
    def _send_all(active: list[_Worker], msg: tuple[Any, ...]) -> None:
        for w in active:
            with contextlib.suppress(OSError, ValueError):
                w.conn.send(msg)


def _add_blocking_reader(loop: asyncio.AbstractEventLoop, conn: Connection, callback: Callable[..., None],
                         *args: Any) -> None:
    """Call ``callback`` when ``conn`` is readable, keeping the socket BLOCKING.

    uvloop (libuv) switches a watched fd to non-blocking; a pickled message larger than one
    read would then fail half-way with EAGAIN on ``recv``, and a large ``send`` with a full
    buffer. Blocking is what ``Connection`` expects: once the first byte is there, the rest
    of the message is being written by the other side, so the wait is short.
    """
    loop.add_reader(conn.fileno(), callback, *args)
    os.set_blocking(conn.fileno(), True)


async def _wait_stop(stop: Stop) -> None:
    assert stop.event is not None
    await stop.event.wait()


def merge_client_checks(stats: list[dict[str, Any] | None], pids: list[int]) -> dict[str, Any]:
    """One self-check for a point run by several processes.

    ``cpu_pct`` is the BUSIEST process's share of a core (each process is one thread, so that
    is what saturates first and what the client-limited check compares with 90 %);
    ``cpu_pct_total`` sums them. Loop lag pools every process's probe samples.
    """
    lags: list[int] = []
    per: list[dict[str, Any]] = []
    cpu_total = 0.0
    wall = 0.0
    for k, st in enumerate(stats):
        if not st:
            per.append({"worker": k, "pid": pids[k], "lost": st is None, "requests": 0})
            continue
        lags.extend(st["lags_ns"])
        cpu_total += st["cpu_s"]
        wall = max(wall, st["wall_s"])
        one = lag_stats(st["lags_ns"])
        per.append({"worker": k, "pid": pids[k], "requests": st["requests"], "cpu_s": st["cpu_s"],
                    "cpu_pct": 100.0 * st["cpu_s"] / st["wall_s"] if st["wall_s"] > 0 else None,
                    "loop_lag_p99_ms": one["loop_lag_p99_ms"], "loop_lag_max_ms": one["loop_lag_max_ms"]})
    pcts = [p["cpu_pct"] for p in per if p.get("cpu_pct") is not None]
    return {
        **lag_stats(lags),
        "cpu_s": cpu_total,
        "wall_s": wall,
        "cpu_pct": max(pcts) if pcts else None,
        "cpu_pct_total": 100.0 * cpu_total / wall if wall > 0 else None,
        "processes": len(stats),
        "workers_lost": sum(1 for st in stats if st is None),
        "workers": per,
    }


# -- the worker process ------------------------------------------------------------------

def worker_main(wid: int, conn: Connection, shared: _Shared, url: str, backend: str, timeout_s: float) -> None:
    """Entry of a worker process: serve points until told to exit (or the parent goes away)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(_serve(wid, conn, shared, url, backend, timeout_s))
    finally:
        with contextlib.suppress(Exception):
            loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()
        conn.close()


async def _serve(wid: int, conn: Connection, shared: _Shared, url: str, backend_name: str, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
    stop = Stop()
    stop.event = asyncio.Event()

    def on_readable() -> None:
        try:
            while conn.poll():
                msg = conn.recv()
                if msg[0] == "stop":
                    stop.set()
                inbox.put_nowait(msg)
        except (EOFError, OSError):
            loop.remove_reader(conn.fileno())
            stop.set()
            inbox.put_nowait(("exit",))

    _add_blocking_reader(loop, conn, on_readable)
    backend = get_backend(backend_name)
    plan: PointPlan | None = None
    async with StreamingClient(Endpoint.parse(url), timeout_s=timeout_s) as client:
        while True:
            msg = await inbox.get()
            if msg[0] == "exit":
                return
            if msg[0] == "plan":
                plan = msg[1]
                continue
            if msg[0] != "slice" or plan is None:
                continue  # a stale "stop" from a finished point
            sl: Slice = msg[1]
            stop.flag = False
            stop.event.clear()
            with gc_frozen():  # collect before "ready", not after "go": it would eat into the lead time
                conn.send(("ready",))
                while (go := await inbox.get())[0] not in ("go", "stop", "exit"):
                    pass
                if go[0] == "exit":
                    return
                if go[0] == "stop":
                    conn.send(("done", {}))  # stopped before the start: nothing ran
                    continue
                stats = await _run_slice(replace(sl, start_ns=go[1]), plan, conn, shared, client, backend, stop)
            conn.send(("done", stats))


async def _run_slice(sl: Slice, plan: PointPlan, conn: Connection, shared: _Shared, client: StreamingClient,
                     backend: Any, stop: Stop) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    state = PointState(label="", total=None, started_ns=now_ns())
    gate = _SharedGate(shared, plan, stop)
    batch: list[dict[str, Any]] = []
    flush_at: list[asyncio.TimerHandle | None] = [None]

    def counts() -> tuple[int, int, int, int, int]:
        return state.sent, state.done, state.failed, state.tokens, state.in_flight

    def flush() -> None:
        if flush_at[0] is not None:
            flush_at[0].cancel()
            flush_at[0] = None
        if batch:
            conn.send(("recs", batch, counts()))
            batch.clear()

    def emit(rec: RequestRecord) -> None:
        batch.append(rec.to_dict())
        if len(batch) >= BATCH_RECORDS:
            flush()
        elif flush_at[0] is None:
            flush_at[0] = loop.call_later(BATCH_S, flush)

    async def heartbeat() -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            conn.send(("prog", counts()))

    lag_task = loop.create_task(lag_monitor(state))
    hb_task = loop.create_task(heartbeat())
    cpu0 = time.process_time()
    w0 = max(now_ns(), sl.start_ns)
    try:
        await drive(sl, gate, client, backend, plan.bodies, plan.prompts, emit, state, stop)
    finally:
        for t in (lag_task, hb_task):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        flush()
        conn.send(("prog", counts()))
    wall_s = (now_ns() - w0) / 1e9
    return {"lags_ns": state.lags_ns, "cpu_s": time.process_time() - cpu0, "wall_s": wall_s,
            "requests": state.done, "pid": os.getpid()}
