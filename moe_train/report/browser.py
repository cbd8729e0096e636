"""Render a report page in headless Chromium and say what a reader would see.

``render(html_path, screenshot)`` starts ``chromium --headless --remote-debugging-pipe`` and
drives it over the DevTools protocol (JSON messages ending in NUL on file descriptors 3 and
4; only the standard library is needed): it opens the page, waits for the load event, lists
every ``<img>`` with its decoded size, collects console errors, uncaught exceptions and
browser log errors, and saves a full-page PNG screenshot.

``python -m moe_train.report.browser RUN_DIR`` does that for ``RUN_DIR/report.html`` and
writes ``RUN_DIR/report/screenshot.png``; exit 1 when an image failed or an error was logged.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--no-default-browser-check",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
)
MAX_SHOT_HEIGHT = 20000  # px; taller pages are cut in the screenshot
_TRAMPOLINE = (
    "import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4); "
    "os.execvp(sys.argv[3], sys.argv[3:])"
)
IMAGES_JS = (
    "JSON.stringify(Array.from(document.images).map(i => ({id: i.id, complete: i.complete,"
    " width: i.naturalWidth, height: i.naturalHeight, shown: i.getBoundingClientRect().width}))"
    ")"
)


@dataclass(frozen=True)
class Rendered:
    """What Chromium made of the page."""

    title: str  # document.title
    images: tuple[dict[str, Any], ...]  # per <img>: id, complete, width, height (decoded), shown
    errors: tuple[str, ...]  # console errors, uncaught exceptions, browser log errors
    screenshot: Path | None  # the PNG written, if one was asked for


class BrowserError(RuntimeError):
    """Chromium could not be started or stopped answering."""


def find_browser() -> str | None:
    """Path of a Chromium-like browser on PATH, or None."""
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


class _Pipe:
    """The DevTools protocol over Chromium's --remote-debugging-pipe."""

    def __init__(self, to_browser: int, from_browser: int, timeout_s: float):
        self.wfd, self.rfd, self.timeout_s = to_browser, from_browser, timeout_s
        self.buffer, self.events, self.next_id = b"", [], 0

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Send one command and return its result (events meanwhile are kept)."""
        self.next_id += 1
        msg: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.wfd, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str) -> dict:
        """The first event named ``method`` (kept or still to come)."""
        while True:
            for ev in self.events:
                if ev.get("method") == method:
                    return ev
            self.events.append(self._read())

    def _read(self) -> dict:
        deadline = time.monotonic() + self.timeout_s
        while b"\0" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.rfd], [], [], left)[0]:
                raise BrowserError(f"no answer from the browser within {self.timeout_s} s")
            chunk = os.read(self.rfd, 1 << 16)
            if not chunk:
                raise BrowserError("the browser closed the pipe")
            self.buffer += chunk
        raw, _, self.buffer = self.buffer.partition(b"\0")
        return json.loads(raw)


def _high(fd: int) -> int:
    """``fd`` moved to a number >= 10, so that the shell's 3/4 redirections cannot clash."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


def _errors(events: list[dict]) -> list[str]:
    """Console errors, uncaught exceptions and browser log errors among ``events``."""
    out = []
    for ev in events:
        p = ev.get("params", {})
        if ev.get("method") == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append(
                "console: "
                + " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
            )
        elif ev.get("method") == "Runtime.exceptionThrown":
            out.append("exception: " + str(p.get("exceptionDetails", {}).get("text")))
        elif ev.get("method") == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            out.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}".strip())
    return out


def _inspect(pipe: _Pipe, url: str, screenshot: Path | None, width: int) -> Rendered:
    """Open ``url`` in a new tab and read back images, errors and a screenshot."""
    target = pipe.call("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = pipe.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Page", "Runtime", "Log"):
        pipe.call(f"{domain}.enable", session=session)
    pipe.call(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False},
        session,
    )
    pipe.call("Page.navigate", {"url": url}, session)
    pipe.wait_event("Page.loadEventFired")

    def evaluate(expr: str) -> Any:
        return pipe.call("Runtime.evaluate", {"expression": expr, "returnByValue": True}, session)[
            "result"
        ].get("value")

    images = json.loads(evaluate(IMAGES_JS))
    title = evaluate("document.title")
    if screenshot is not None:
        size = pipe.call("Page.getLayoutMetrics", session=session)["cssContentSize"]
        clip = {
            "x": 0,
            "y": 0,
            "width": width,
            "scale": 1,
            "height": min(int(size["height"]), MAX_SHOT_HEIGHT),
        }
        shot = pipe.call(
            "Page.captureScreenshot", {"format": "png", "clip": clip, "captureBeyondViewport": True}, session
        )
        screenshot.write_bytes(base64.b64decode(shot["data"]))
    return Rendered(title, tuple(images), tuple(_errors(pipe.events)), screenshot)


def render(
    html_path: Path,
    screenshot: Path | None = None,
    *,
    browser: str | None = None,
    width: int = 1200,
    timeout_s: float = 60.0,
) -> Rendered:
    """Load ``html_path`` in headless Chromium; BrowserError when it cannot."""
    browser = browser or find_browser()
    if browser is None:
        raise BrowserError(f"no browser found (tried {', '.join(BROWSERS)})")
    to_r, to_w = map(_high, os.pipe())
    from_r, from_w = map(_high, os.pipe())
    with tempfile.TemporaryDirectory(prefix="moe_report_browser_") as profile:
        # a tiny Python trampoline puts our pipe ends on fds 3 and 4 and execs the browser
        # (no preexec_fn: this process may run threads, e.g. a telemetry sampler)
        cmd = [
            sys.executable,
            "-c",
            _TRAMPOLINE,
            str(to_r),
            str(from_w),
            browser,
            *FLAGS,
            f"--user-data-dir={profile}",
            "about:blank",
        ]
        proc = subprocess.Popen(
            cmd,
            pass_fds=(to_r, from_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_r)
        os.close(from_w)
        pipe = _Pipe(to_w, from_r, timeout_s)
        try:
            return _inspect(pipe, Path(html_path).resolve().as_uri(), screenshot, width)
        finally:
            try:
                pipe.call("Browser.close")
            except (BrowserError, OSError):
                pass
            os.close(to_w)
            os.close(from_r)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main(argv: list[str] | None = None) -> int:
    """Check RUN_DIR/report.html in Chromium and keep RUN_DIR/report/screenshot.png."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m moe_train.report.browser RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(args[0])
    result = render(run_dir / "report.html", run_dir / "report" / "screenshot.png")
    bad = [i for i in result.images if not (i["complete"] and i["width"] > 0 and i["shown"] > 0)]
    for line in result.errors:
        print(f"error: {line}")
    for img in bad:
        print(f"image not shown: {img}")
    print(
        f"{len(result.images) - len(bad)}/{len(result.images)} images shown, "
        f"{len(result.errors)} errors; screenshot {result.screenshot}"
    )
    return 1 if bad or result.errors else 0


if __name__ == "__main__":
    sys.exit(main())
