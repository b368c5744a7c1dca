"""The HTML report in a real browser: headless Chromium renders its tables and images without console errors.

Chromium is driven through the DevTools protocol over ``--remote-debugging-pipe`` (file descriptors 3 and
4, NUL-separated JSON) with the standard library only: console messages, uncaught exceptions, log entries
and every network request are recorded, the DOM is queried after the load event and a screenshot taken.
Under ``CI=true`` a missing ``chromium`` fails the test instead of skipping it (``.ci/run`` installs it).
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from queue import Empty, Queue

import pytest

from tests.unit.analysis.test_analysis import DATASETS, expected_best, make_study, raw_trials

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def require_chromium() -> str:
    if CHROMIUM:
        return CHROMIUM
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail("chromium is not installed; .ci/run installs Debian's chromium package before the tests")
    pytest.skip("chromium not installed (apt-get install -y chromium); CI=true turns this into a failure")


class Browser:
    """A headless Chromium page driven over the DevTools pipe."""

    def __init__(self, binary: str, profile: Path, *, width: int = 1280, height: int = 1800):
        r_cmd, w_cmd = os.pipe()  # we write commands -> chromium reads fd 3
        r_res, w_res = os.pipe()  # chromium writes fd 4 -> we read
        # Move the child's ends above 10 so that wiring them to 3 and 4 cannot clobber one with the other.
        child_in, child_out = fcntl.fcntl(r_cmd, fcntl.F_DUPFD, 10), fcntl.fcntl(w_res, fcntl.F_DUPFD, 10)
        os.close(r_cmd)
        os.close(w_res)
        # bash (dash cannot name descriptors above 9) maps them onto the descriptors Chromium expects, then
        # execs the browser; a preexec_fn cannot do it, subprocess closes 3 and 4 after calling it.
        wire = f'exec "$0" "$@" 3<&{child_in} 4>&{child_out} {child_in}<&- {child_out}>&-'
        args = ["bash", "-c", wire, binary, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
                f"--user-data-dir={profile}", "--no-first-run", "--no-default-browser-check",
                "--disable-extensions", "--disable-background-networking", "--disable-sync",
                "--disable-dev-shm-usage", "--hide-scrollbars", f"--window-size={width},{height}", "about:blank"]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, pass_fds=(child_in, child_out))
        os.close(child_in)
        os.close(child_out)
        self._out = os.fdopen(w_cmd, "wb", buffering=0)
        self._in = os.fdopen(r_res, "rb", buffering=0)
        self._queue: Queue = Queue()
        self.events: list[dict] = []
        self._id = 0
        threading.Thread(target=self._reader, daemon=True).start()
        self.session = None

    def _reader(self) -> None:
        buf = b""
        while chunk := self._in.read(65536):
            buf += chunk
            *messages, buf = buf.split(b"\0")
            for m in messages:
                self._queue.put(json.loads(m))
        self._queue.put(None)

    def send(self, method: str, params: dict | None = None, *, session: bool = True, timeout: float = 60) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        self._out.write(json.dumps(msg).encode() + b"\0")
        return self._wait(lambda m: m.get("id") == self._id, timeout, method)

    def wait_event(self, method: str, timeout: float = 60) -> dict:
        for e in self.events:
            if e.get("method") == method:
                return e
        return self._wait(lambda m: m.get("method") == method, timeout, method)

    def _wait(self, match, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                m = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except Empty:
                raise TimeoutError(f"chromium: no answer to {what} within {timeout:.0f} s") from None
            if m is None:
                raise RuntimeError(f"chromium exited while waiting for {what}: {self.proc.stderr.read()[-2000:]!r}")
            if "method" in m:
                self.events.append(m)
            if match(m):
                if "error" in m:
                    raise RuntimeError(f"chromium: {what} failed: {m['error']}")
                return m.get("result", m.get("params", {}))

    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")
        self.send("Page.navigate", {"url": url})
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str):
        res = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in res:
            raise RuntimeError(f"evaluate failed: {res['exceptionDetails']}")
        return res["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        data = self.send("Page.captureScreenshot", {"format": "png"})["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def problems(self) -> list[str]:
        """Console errors/warnings-as-errors, uncaught exceptions, error log entries, failed or remote loads."""
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(f"console.{p['type']}: {[a.get('value', a.get('description')) for a in p['args']]}")
            elif m == "Runtime.exceptionThrown":
                out.append(f"exception: {p['exceptionDetails'].get('exception', {}).get('description')}")
            elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(f"log: {p['entry']['text']} {p['entry'].get('url', '')}")
            elif m == "Network.loadingFailed":
                out.append(f"load failed: {p.get('errorText')}")
            elif m == "Network.requestWillBeSent":
                url = p["request"]["url"]
                if not url.startswith(("data:", "file:", "about:")):
                    out.append(f"remote request (the report must open offline): {url[:120]}")
        return out

    def close(self) -> None:
        try:
            self.send("Browser.close", session=False, timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()


@pytest.fixture()
def browser(tmp_path):
    b = Browser(require_chromium(), tmp_path / "profile", width=1400)  # the window the reader used
    yield b
    b.close()


PAGE_STATE = """({
  imagesOk: document.body.dataset.imagesOk,
  images: Array.from(document.images).map(i => [i.dataset.figure, i.naturalWidth, i.naturalHeight]),
  tables: Array.from(document.querySelectorAll('table[data-table]')).map(t => [t.dataset.table,
          t.querySelectorAll('tbody tr').length, t.getBoundingClientRect().width]),
  headings: Array.from(document.querySelectorAll('h2')).map(h => h.textContent),
  scrolling: Array.from(document.querySelectorAll('.table-scroll')).filter(d => d.scrollWidth > d.clientWidth + 1)
             .map(d => d.querySelector('table').dataset.table),
  text: document.body.innerText,
})"""


def test_report_renders_in_headless_chromium(tmp_path, browser):
    from raystudy.analysis import report

    d = make_study(tmp_path / "study", rates=True, datasets=DATASETS[:2])
    path = report(d)
    html = path.read_text()
    assert "http://" not in html and "https://" not in html  # nothing to fetch: opens offline
    browser.open(path.as_uri())
    state = browser.evaluate(PAGE_STATE)
    assert browser.problems() == []
    assert state["imagesOk"] == "true"
    figures = sorted(p.stem for p in (d / "analysis" / "figures").glob("*.png"))
    # plasticity (depth, boxes, rate violins, bounds), accuracy (distribution, fixed lr x 2 optimizers, vs lr,
    # best: mean over datasets and per dataset, vs params), relative gain, and per dataset and optimizer the
    # best-run and every-run curves (2 x 2 x 2)
    assert sorted(name for name, _, _ in state["images"]) == figures and len(figures) == 4 + 7 + 1 + 8
    assert all(w > 600 and h > 300 for _, w, h in state["images"])
    names = [name for name, _, _ in state["tables"]]
    for t in ("best_lr", "lr_grid", "overall", "relative_gain", "optimizers", "wilcoxon", "stability", "ranking",
              "cost"):
        assert t in names
    assert all(rows > 0 and width > 200 for _, rows, width in state["tables"])
    assert state["scrolling"] == []  # every table fits a 1,400 px window (the cost table needed scrolling)
    assert state["headings"] == ["Summary", "What this study can show", "Notes", "Tables", "Figures"]
    # A value computed here from the raw trials is on the page as a percentage.
    _lr, mean, std, _n = expected_best(raw_trials(d))[("vit_tiny", "cifar10", "sgd", "MHA")]
    assert f"{100 * mean:.1f} ± {100 * std:.1f}" in state["text"]
    shot = browser.screenshot(tmp_path / "report.png")
    assert shot.stat().st_size > 20_000
    if os.environ.get("RAYSTUDY_KEEP_SCREENSHOT"):
        shutil.copy(shot, os.environ["RAYSTUDY_KEEP_SCREENSHOT"])


def test_browser_check_catches_broken_pages(tmp_path, browser):
    """Negative control: the same checks flag a console error, an exception and an undecodable image."""
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><html><body data-images-ok="pending"><img src="data:image/png;base64,AAAA">'
                    "<script>console.error('boom'); window.addEventListener('load', () => {"
                    "document.body.dataset.imagesOk = Array.from(document.images).every(i => i.naturalWidth > 0)"
                    " ? 'true' : 'false'; undefinedFunction(); });</script></body></html>")
    browser.open(page.as_uri())
    state = browser.evaluate("document.body.dataset.imagesOk")
    problems = browser.problems()
    assert state == "false"
    assert any("boom" in p for p in problems) and any("undefinedFunction" in p for p in problems)
