"""Headless Chromium for the report tests: a screenshot of a page, and the page's layout as
the browser itself measured it (how wide the document is at a window width, which table boxes
scroll, at what size each image is shown). Chromium's own command-line flags only, no browser
automation package: the layout comes from a copy of the page with a small script that writes
its measurements into the DOM, read back with ``--dump-dom``."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["chromium", "screenshot", "layout"]

#: Flags that run here as root in a container: no sandbox, no GPU, no network chatter, and a
#: fresh profile per call (added by :func:`_run`).
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--mute-audio")

_PROBE = """<script>
window.addEventListener('load', () => {
  const d = document.documentElement;
  const out = {viewport: window.innerWidth, scrollWidth: d.scrollWidth,
    clientWidth: d.clientWidth, height: d.scrollHeight,
    boxes: [...document.querySelectorAll('.box')].map(b => (
      {scroll: b.scrollWidth, client: b.clientWidth, text: b.innerText.slice(0, 40)})),
    images: [...document.images].map(i => ({alt: i.alt, natural: i.naturalWidth,
      shown: i.getBoundingClientRect().width, right: i.getBoundingClientRect().right,
      top: i.getBoundingClientRect().top})),
    broken: [...document.querySelectorAll('th, td')].flatMap(c => {
      const out = [], walk = document.createTreeWalker(c, NodeFilter.SHOW_TEXT);
      for (let n = walk.nextNode(); n; n = walk.nextNode()) {
        for (const m of n.data.matchAll(/[^\\s-]+/g)) {
          const r = document.createRange();
          r.setStart(n, m.index);
          r.setEnd(n, m.index + m[0].length);
          const tops = new Set([...r.getClientRects()].map(x => Math.round(x.top)));
          if (tops.size > 1) out.push(m[0]);
        }
      }
      return out;
    })};
  const pre = document.createElement('pre');
  pre.id = 'hpcpar-layout';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def chromium() -> str | None:
    """The Chromium executable (``chromium`` on PATH, else ``/usr/bin/chromium``), or None."""
    found = shutil.which("chromium")
    return found or ("/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None)


def _run(args: list[str], page: Path, timeout: float) -> subprocess.CompletedProcess:
    exe = chromium()
    if exe is None:
        raise FileNotFoundError("chromium is not installed")
    with tempfile.TemporaryDirectory(prefix="hpcpar-chromium-") as profile:
        proc = subprocess.run([exe, *FLAGS, f"--user-data-dir={profile}", *args,
                               Path(page).resolve().as_uri()], capture_output=True, text=True,
                              timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"chromium exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc


def layout(page: str | os.PathLike, width: int = 1400, timeout: float = 120) -> dict:
    """Load ``page`` in a window ``width`` px wide and return what the browser measured.

    Returns:
        ``viewport`` (the window's inner width), ``scrollWidth`` / ``clientWidth`` of the
        document (wider scroll: the page overflows sideways), ``height``, per ``.box`` (the
        report's table boxes) its ``scroll`` and ``client`` width, per image its ``alt``,
        ``natural`` width, ``shown`` width, ``right`` edge and ``top``, and ``broken``: each
        word of a table cell or header that the browser split over two lines (a mid-word
        wrap such as "speedu p"; a break after a hyphen is no split).
    """
    page = Path(page)
    text = page.read_text()
    probed = text.replace("</body>", _PROBE + "</body>") if "</body>" in text else \
        text + _PROBE
    with tempfile.TemporaryDirectory(prefix="hpcpar-layout-") as tmp:
        copy = Path(tmp) / page.name  # beside nothing: the reports are self-contained
        copy.write_text(probed)
        dom = _run([f"--window-size={width},900", "--virtual-time-budget=10000",
                    "--dump-dom"], copy, timeout).stdout
    m = re.search(r'<pre id="hpcpar-layout">(.*?)</pre>', dom, re.S)
    if not m:
        raise RuntimeError(f"the page's layout was not written (the page did not load?): "
                           f"{dom[-500:]!r}")
    return json.loads(html.unescape(m.group(1)))


def screenshot(page: str | os.PathLike, png: str | os.PathLike, width: int = 1400,
               height: int | None = None, timeout: float = 120) -> Path:
    """A PNG of ``page`` in a window ``width`` px wide, the whole page tall (its measured
    height, at most 16384 px) unless ``height`` is given."""
    if height is None:
        height = min(int(layout(page, width, timeout)["height"]) + 16, 16384)
    png = Path(png).resolve()
    _run([f"--window-size={width},{height}", f"--screenshot={png}"], Path(page), timeout)
    if not png.is_file():
        raise RuntimeError(f"chromium wrote no screenshot at {png}")
    return png
