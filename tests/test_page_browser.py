"""The HTML page in a real browser: headless Chromium (Debian's package) loads the page `checks report` writes,
from disk, and is asked over the DevTools protocol (a pipe, standard library only) what it rendered.

Skips only when no chromium is installed; with STACKPROBE_REQUIRE_BROWSER=1 (set by .ci/run) it fails instead.
The screenshot goes to .cache/ci-artifacts/compatibility.png for people to look at."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from checks.report.report import generate
from tests.checks_helpers import ROOT, committed

ARTIFACTS = ROOT / ".cache" / "ci-artifacts"
REQUIRE = os.environ.get("STACKPROBE_REQUIRE_BROWSER") == "1"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--remote-debugging-pipe")
TIMEOUT_S = 60.0


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if REQUIRE:
        pytest.fail("STACKPROBE_REQUIRE_BROWSER=1 but no chromium on PATH (apt-get install -y chromium)")
    pytest.skip("no chromium on PATH (apt-get install -y chromium)")


class Browser:
    """One headless Chromium spoken to over --remote-debugging-pipe: JSON messages ending in NUL, commands on
    its fd 3, answers and events on its fd 4."""

    def __init__(self, binary: str, profile: Path) -> None:
        to_child, self._w = os.pipe()
        self._r, from_child = os.pipe()

        def fds() -> None:
            os.dup2(to_child, 3)
            os.dup2(from_child, 4)

        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     preexec_fn=fds, close_fds=False)
        os.close(to_child)
        os.close(from_child)
        self._buf = b""
        self._next = 0
        self.events: list[dict[str, Any]] = []
        self.session: str | None = None

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError("chromium did not answer")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium exited: {self.proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
            self._buf += chunk
        msg, _, self._buf = self._buf.partition(b"\0")
        return json.loads(msg)

    def send(self, method: str, params: dict[str, Any] | None = None, session: bool = True) -> dict[str, Any]:
        self._next += 1
        msg: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def attach(self) -> None:
        """Speak to the browser's page from here on, with its page, runtime and log events reported."""
        targets = self.send("Target.getTargets", session=False)["targetInfos"]
        page_target = next(t for t in targets if t["type"] == "page")
        self.session = self.send("Target.attachToTarget", {"targetId": page_target["targetId"], "flatten": True},
                                 session=False)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable")

    def wait_for(self, method: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not any(e.get("method") == method for e in self.events):
            self.events.append(self._read(deadline))

    def evaluate(self, expression: str) -> Any:
        out = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        assert "exceptionDetails" not in out, out
        return out["result"].get("value")

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, TimeoutError, OSError):  # it may be gone already
            self.send("Browser.close", session=False)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._w)
        os.close(self._r)


PROBE_PAGE = """(() => {
  const shown = el => !!el && el.getClientRects().length > 0 && getComputedStyle(el).visibility !== 'hidden';
  const box = el => { const r = el.getBoundingClientRect(); return [Math.round(r.width), Math.round(r.height)]; };
  const answer = document.querySelector('#answer table.answer');
  const plots = [...document.querySelectorAll('svg.plot')].filter(shown);
  const labels = [...document.querySelectorAll('#picker label')].filter(shown);
  const statusTags = [...document.querySelectorAll('td .st')].filter(shown);
  return {
    title: document.title,
    answer_rows: answer ? answer.rows.length : 0,
    answer_shown: shown(answer),
    answer_top: answer ? Math.round(answer.getBoundingClientRect().top) : -1,
    picker_labels: labels.map(l => l.getAttribute('for')),
    plots: plots.length,
    plot_boxes: plots.map(box),
    plot_lines: plots.map(p => p.querySelectorAll('polyline').length),
    plot_bars: plots.map(p => p.querySelectorAll('rect').length),
    gpu_sections: [...document.querySelectorAll('section.host.gpu')].map(shown),
    nogpu_sections: [...document.querySelectorAll('section.host.nogpu')].map(shown),
    status_tags: statusTags.length,
    status_tag_boxes_ok: statusTags.every(s => box(s)[0] > 8 && s.textContent.trim().length > 0),
    emoji: /[\\u2705\\u274c\\u2796\\u{1F7E1}\\u{1F4A5}\\u23f3\\u23f8\\u{1F6AB}]/u.test(document.body.innerText),
  };
})()"""

# What a reader reads off the first screen: per declared stack, the words the SM120 (12.0a) fusion-JIT row shows
# for the no-GPU class (the only one that cross-compiles), and per stack the first backend advised at 2 ranks on
# the 2x H200 class.
ANSWERS = """(() => {
  const shown = el => !!el && el.getClientRects().length > 0;
  const heads = [...document.querySelectorAll('#answer table.answer tr:first-child th.stk')].map(th => th.dataset.cell);
  const row = document.querySelector('#answer tr.feat-fusion-jit-sm120a');
  const sm120 = {};
  [...row.querySelectorAll('td.stk')].forEach((td, i) => {
    const v = [...td.querySelectorAll('.v')].find(v => v.dataset.class === 'no GPU');
    if (v && shown(v)) sm120[heads[i]] = v.innerText.replace(/\\s+/g, ' ').trim();
  });
  const advised = {};
  [...document.querySelectorAll('#launch li')].filter(li => li.dataset.class.startsWith('H200 ×2')
    && li.dataset.ranks === '2' && shown(li)).forEach(li => { advised[li.dataset.cell] =
      li.querySelector('.use').innerText; });
  return {sm120, advised};
})()"""

FILTERED = """(() => {
  const shown = el => !!el && el.getClientRects().length > 0;
  const rows = [...document.querySelectorAll('#answer tr.feat')].filter(shown);
  return {
    rows: rows.map(r => r.dataset.feature),
    columns: [...document.querySelectorAll('#answer th.stk')].filter(shown).map(th => th.dataset.cell),
    classes: [...new Set([...document.querySelectorAll('#answer .v')].filter(shown).map(v => v.dataset.class))],
    launch: [...document.querySelectorAll('#launch li')].filter(shown).length,
    host_sections: [...document.querySelectorAll('section.host')].filter(shown).length,
  };
})()"""

AFTER_PICKING = """(() => {
  const shown = el => !!el && el.getClientRects().length > 0;
  const rows = [...document.querySelectorAll('section.host tr.r')].filter(shown);
  return {
    gpu_sections: [...document.querySelectorAll('section.host.gpu')].map(shown),
    nogpu_sections: [...document.querySelectorAll('section.host.nogpu')].map(shown),
    rows: rows.length,
    rows_without_bad: rows.filter(r => !/has-(fail|crash|hang)/.test(r.className)).length,
  };
})()"""


def _errors(events: list[dict[str, Any]]) -> list[str]:
    out = []
    for e in events:
        m, p = e.get("method"), e.get("params", {})
        if m == "Runtime.exceptionThrown":
            details = p.get("exceptionDetails", {})
            out.append(f"{details.get('text')} {details.get('exception', {}).get('description', '')}".strip())
        elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append(f"console.{p['type']}: {p.get('args')}")
        elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            out.append(f"log: {p['entry'].get('text')}")
    return out


def _click(browser: Browser, *ids: str) -> None:
    browser.evaluate("".join(f"document.querySelector('label[for=\"{i}\"]').click();" for i in ids))


def test_page_answers_first_filters_and_shows_every_host_in_chromium(tmp_path: Path) -> None:
    binary = _chromium()
    out = tmp_path / "docs" / "compatibility.md"
    assert generate(committed(), out, None, check=False, quiet=True) == 0
    page = out.with_suffix(".html")
    profile = Path(tempfile.mkdtemp(prefix="chromium-profile-", dir=tmp_path))
    browser = Browser(binary, profile)
    try:
        browser.attach()
        browser.send("Emulation.setDeviceMetricsOverride", {"width": 1400, "height": 2000, "deviceScaleFactor": 1,
                                                            "mobile": False})
        browser.send("Page.navigate", {"url": page.as_uri()})
        browser.wait_for("Page.loadEventFired")
        seen = browser.evaluate(PROBE_PAGE)
        answers = browser.evaluate(ANSWERS)
        shot = browser.send("Page.captureScreenshot", {"format": "png"})
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / "compatibility.png").write_bytes(base64.b64decode(shot["data"]))
        _click(browser, "ff-fusion-jit-sm120a")
        one_feature = browser.evaluate(FILTERED)
        _click(browser, "ff-all", "fs-0")
        one_stack = browser.evaluate(FILTERED)
        _click(browser, "fs-all", "fc-nogpu")
        one_class = browser.evaluate(FILTERED)
        _click(browser, "fc-all")
        every = browser.evaluate(FILTERED)
        cpu = next(f for f in seen["picker_labels"] if f.startswith("pick-cpu-"))
        _click(browser, cpu)
        picked_cpu = browser.evaluate(AFTER_PICKING)
        _click(browser, "pick-all", "f-bad")
        filtered = browser.evaluate(AFTER_PICKING)
        _click(browser, "f-any")
        unfiltered = browser.evaluate(AFTER_PICKING)
        errors = _errors(browser.events)
    finally:
        browser.close()
    assert seen["title"].startswith("stackprobe")
    assert seen["answer_shown"] and seen["answer_rows"] >= 13  # a header and one row per feature
    assert 0 <= seen["answer_top"] < 1000  # the first screen holds the answer
    assert {"ff-all", "fs-all", "fc-all", "fc-nogpu", "pick-all", "pick-gpu", "f-any", "f-bad"} <= set(
        seen["picker_labels"])
    # the SM120 fusion JIT per flashinfer release, read off the page: 0.6.16 refuses SM12x, 0.6.17 on compiles
    assert answers["sm120"]["cu130-torch2.14.1-sgl0.4.10-fi0.6.16"] == "no GPU FAIL fi-arch-gate"
    assert answers["sm120"]["cu130-torch2.14.1-sgl0.4.10-fi0.6.17"] == "no GPU pass"
    assert answers["sm120"]["cu130-torch2.14.1-sgl0.4.10-fi0.7.2"] == "no GPU pass"
    assert answers["sm120"]["cu132-torch2.15.0-sglnone-fi0.7.4"] == "no GPU pass"
    # the backend the 2x H200 is advised at 2 ranks for the smallest decode sizes
    assert answers["advised"]["cu130-torch2.11.0-sglnone-fi0.7.4"] == "flashinfer-pcie-ipc"
    assert answers["advised"]["cu130-torch2.11.0-sglnone-fi0.6.17"] == "flashinfer-custom-ar"
    # each filter leaves what it names: one feature's row, one stack's column, one class's verdicts
    assert one_feature["rows"] == ["fusion-jit-sm120a"] and len(one_feature["columns"]) == len(every["columns"])
    assert one_stack["columns"] == every["columns"][:1] and one_stack["rows"] == every["rows"]
    assert one_class["classes"] == ["no GPU"] and one_class["launch"] == 0 and one_class["host_sections"] == 2
    assert len(every["classes"]) >= 4 and every["launch"] >= 4
    # the page opens on every host: a GPU-less user's own section is shown, as are the GPU hosts
    assert len(seen["gpu_sections"]) >= 2 and all(seen["gpu_sections"])
    assert seen["nogpu_sections"] and all(seen["nogpu_sections"])
    assert seen["plots"] >= 6 and all(w >= 300 and h >= 100 for w, h in seen["plot_boxes"])
    assert max(seen["plot_lines"]) >= 5  # NCCL and four other backends on one plot
    assert any(n >= 8 for n in seen["plot_bars"])  # the estimate's bars
    assert seen["status_tags"] > 100 and seen["status_tag_boxes_ok"] and not seen["emoji"]
    # picking one GPU-less host shows that host alone
    assert picked_cpu["nogpu_sections"].count(True) == 1 and not any(picked_cpu["gpu_sections"])
    assert filtered["rows"] > 0 and filtered["rows_without_bad"] == 0
    assert unfiltered["rows"] > filtered["rows"]
    assert errors == []
    assert (ARTIFACTS / "compatibility.png").stat().st_size > 10_000


PAYLOAD_PAGE = """(() => ({
  scripts: document.querySelectorAll('script').length,
  images: document.querySelectorAll('img').length,
  handlers: [...document.querySelectorAll('*')].filter(el => [...el.attributes].some(a => /^on/i.test(a.name)))
    .length,
  js_links: [...document.querySelectorAll('[href],[src],[action]')].filter(el =>
    /^\\s*javascript:/i.test(el.getAttribute('href') || el.getAttribute('src') || el.getAttribute('action') || ''))
    .length,
  alerted: !!window.__alerted,
  shown: document.body.innerText.includes('<script>alert(1)</script>'),
}))()"""


def test_a_page_from_payload_results_runs_none_of_them(tmp_path: Path) -> None:
    """Every text field of an imported bundle carries HTML, markdown and shell payloads
    (tests/test_checks_exchange.py): opened in Chromium, the page shows them as text and runs none."""
    from tests.test_checks_exchange import payload_results

    binary = _chromium()
    res = payload_results(tmp_path)
    out = tmp_path / "docs" / "compatibility.md"
    assert generate(res, out, None, check=False, quiet=True) == 0
    browser = Browser(binary, Path(tempfile.mkdtemp(prefix="chromium-profile-", dir=tmp_path)))
    try:
        browser.attach()
        browser.send("Page.addScriptToEvaluateOnNewDocument",  # an alert anywhere would be recorded
                     {"source": "window.alert = () => { window.__alerted = true; };"})
        browser.send("Page.navigate", {"url": out.with_suffix(".html").as_uri()})
        browser.wait_for("Page.loadEventFired")
        seen = browser.evaluate(PAYLOAD_PAGE)
    finally:
        browser.close()
    assert seen == {"scripts": 0, "images": 0, "handlers": 0, "js_links": 0, "alerted": False, "shown": True}, seen
