"""A minimal DevTools-protocol driver for Debian's headless ``chromium``, for the report tests.

Why the DevTools protocol rather than ``--dump-dom``: console errors, uncaught exceptions,
CSP violations (which Chromium reports as console errors) and network requests are events,
and only a live session sees them. aiohttp (a servescope dependency) speaks the websocket.

Chromium runs in its own session (process group) with a throw-away profile, bound to
127.0.0.1 on a port it picks itself; ``close`` ends that group, and only that group.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_LISTENING = re.compile(r"DevTools listening on (ws://[^\s]+)")


def _drain(stream: Any) -> None:
    for _ in stream:
        pass


def find_chromium() -> str | None:
    """The browser binary, or None (then the browser tests skip with a reason)."""
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageLog:
    """What the page did while loading: console errors, exceptions, dialogs, requests."""

    console_errors: list[str] = field(default_factory=list)
    exceptions: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    loaded: bool = False

    @property
    def external_requests(self) -> list[str]:
        """Requests for anything other than the file itself, inline data or about:blank."""
        return [u for u in self.requests if not u.startswith(("file:", "data:", "about:"))]


class HeadlessChromium:
    """``async with HeadlessChromium(binary) as browser: log = await browser.load(path)``."""

    def __init__(self, binary: str, startup_timeout_s: float = 60.0) -> None:
        self.binary = binary
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._profile: tempfile.TemporaryDirectory[str] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._events: list[dict[str, Any]] = []
        self._event_signal = asyncio.Event()
        self._dialog_tasks: list[asyncio.Task[dict[str, Any]]] = []

    async def __aenter__(self) -> HeadlessChromium:
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _start(self) -> None:
        self._profile = tempfile.TemporaryDirectory(prefix="servescope-chromium-")
        args = [
            self.binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--no-default-browser-check",
            "--disable-dev-shm-usage", f"--user-data-dir={self._profile.name}", "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0", "--enable-logging=stderr", "--v=0", "about:blank",
        ]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        ws_url = await asyncio.wait_for(asyncio.to_thread(self._read_ws_url), self.startup_timeout_s)
        port = int(ws_url.split(":")[2].split("/")[0])
        self._session = aiohttp.ClientSession()
        page_ws = None
        for _ in range(50):
            async with self._session.get(f"http://127.0.0.1:{port}/json/list") as resp:
                targets = await resp.json(content_type=None)
            page_ws = next((t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page"), None)
            if page_ws:
                break
            await asyncio.sleep(0.1)
        if page_ws is None:
            raise RuntimeError("chromium started but offers no page target")
        self._ws = await self._session.ws_connect(page_ws, max_msg_size=0)
        self._reader = asyncio.create_task(self._read_loop())

    def _read_ws_url(self) -> str:
        assert self._proc is not None and self._proc.stderr is not None
        seen = []
        for raw in self._proc.stderr:
            line = raw.decode("utf-8", "replace")
            seen.append(line)
            m = _LISTENING.search(line)
            if m:
                # Keep draining stderr in the background so chromium never blocks on a full pipe.
                threading.Thread(target=_drain, args=(self._proc.stderr,), daemon=True).start()
                return m.group(1)
        raise RuntimeError("chromium exited before opening DevTools: " + "".join(seen[-20:]))

    async def _read_loop(self) -> None:
        assert self._ws is not None
        async for msg in self._ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            if "id" in data:
                fut = self._pending.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
            else:
                self._events.append(data)
                self._event_signal.set()
                if data.get("method") == "Page.javascriptDialogOpening":
                    # A dialog blocks the page until answered: record it (load() reports it) and dismiss it.
                    self._dialog_tasks.append(asyncio.create_task(
                        self.send("Page.handleJavaScriptDialog", {"accept": True})))

    async def send(self, method: str, params: dict[str, Any] | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
        assert self._ws is not None
        msg_id = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = fut
        await self._ws.send_str(json.dumps({"id": msg_id, "method": method, "params": params or {}}))
        reply = await asyncio.wait_for(fut, timeout_s)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def _wait_event(self, method: str, timeout_s: float) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            if any(e.get("method") == method for e in self._events):
                return True
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return False
            self._event_signal.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._event_signal.wait(), remaining)

    async def load(self, path: Path, timeout_s: float = 60.0, settle_s: float = 0.5) -> PageLog:
        """Open a local file and collect what happened until it loaded (plus ``settle_s``)."""
        for domain in ("Page", "Runtime", "Log", "Network"):
            await self.send(f"{domain}.enable")
        self._events.clear()
        await self.send("Page.navigate", {"url": path.resolve().as_uri()})
        log = PageLog(loaded=await self._wait_event("Page.loadEventFired", timeout_s))
        await asyncio.sleep(settle_s)
        for e in self._events:
            method, params = e.get("method"), e.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                log.console_errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in
                                                   params.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                log.exceptions.append(str(details.get("exception", {}).get("description") or details.get("text")))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                entry = params["entry"]
                log.console_errors.append(f"{entry.get('source')}: {entry.get('text')}")
            elif method == "Page.javascriptDialogOpening":
                log.dialogs.append(str(params.get("message")))
            elif method == "Network.requestWillBeSent":
                log.requests.append(str(params.get("request", {}).get("url")))
        return log

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"evaluate failed: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    async def screenshot(self, width_px: int = 1280, max_height_px: int = 16000, scale: float = 1.0) -> bytes:
        """A PNG of the whole page (up to ``max_height_px``), laid out at ``width_px``."""
        await self.send("Emulation.setDeviceMetricsOverride",
                        {"width": width_px, "height": 900, "deviceScaleFactor": scale, "mobile": False})
        height = int(await self.evaluate("document.documentElement.scrollHeight"))
        height = min(height, max_height_px)
        await self.send("Emulation.setDeviceMetricsOverride",
                        {"width": width_px, "height": height, "deviceScaleFactor": scale, "mobile": False})
        shot = await self.send("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": width_px, "height": height, "scale": 1},
        }, timeout_s=120)
        return base64.b64decode(shot["data"])

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGTERM)  # the group we started: chromium and its helpers
            try:
                await asyncio.to_thread(self._proc.wait, 10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                await asyncio.to_thread(self._proc.wait, 10)
            self._proc = None
        if self._profile is not None:
            self._profile.cleanup()
            self._profile = None
