"""Open every page of the built book in headless Chromium and check what a reader would see.

For each page listed in ``_toc.yml`` (served from ``_build/html`` on 127.0.0.1):

* the page exists (HTTP 200, a title, not an error page);
* every ``<img>`` loaded (``complete`` and ``naturalWidth > 0``);
* where the page has math, MathJax (the vendored copy in ``book/_static/mathjax``, not a CDN)
  rendered it: every ``.math`` element holds an ``mjx-container`` and no raw ``\\[`` / ``\\(``
  is left in the text outside code blocks;
* on the Reference pages (``book/reference/``), every table fits the page width;
* on notebook pages, the Colab launch link points to
  ``https://colab.research.google.com/github/<owner>/<repo>/blob/<branch>/<docname>.ipynb``,
  the repository and branch of ``_config.yml``;
* nothing a reader must not see (``scripts/book_checks.py``, ``page_problems``): no directive
  fence or role left unrendered (a raw ```` ```{admonition} ```` block), no absolute path of the
  building machine (the repository, the Python environment, the home directory, or any
  ``/.../*.py`` file as warnings and tracebacks print them), and no Python warning or other
  stderr output in a cell unless the cell is tagged ``expect-warning``.

Before the real pages it runs a negative control: it loads one page, breaks it in the browser
(a missing image, raw TeX, the Colab link removed, a raw directive fence, a cell whose stderr
output prints a warning with the repository's path) and requires each check to report it, so a
check that cannot fail fails the run.

The browser (:func:`find_browser`): ``$ACCUMCORE_CHROMIUM`` / ``$ACCUMCORE_CHROMEDRIVER`` if
set, else the first of ``chromium``, ``chromium-browser``, ``google-chrome`` (...) on ``PATH``
with a ``chromedriver`` on ``PATH`` (Debian: ``apt-get install chromium chromium-driver``).
With a browser but no driver, Selenium Manager finds a matching driver (it may download one).
``--install-missing`` (what ``scripts/check-book.sh`` passes) installs Debian's packages with
apt-get when none is found and that is possible (root, apt-get present); otherwise the check
fails with one line saying how to install one, or how to skip this one step locally
(``ACCUMCORE_SKIP_BROWSER=1``, refused when ``CI=true``: CI never skips it).

``--install-only`` does only that (no book needed): ``scripts/test.sh`` runs it in the background
while the unit tests run, so that the book step does not wait for apt-get.

Usage: ``python scripts/browser_check.py [--html _build/html] [--install-missing]
[--screenshot out.png [--screenshot-page book/01_eager_loop]]``. Exit status 1 if any page
fails.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

sys.path.insert(0, str(Path(__file__).resolve().parent))
import book_checks  # noqa: E402 - scripts/ is not a package

ROOT = Path(__file__).resolve().parent.parent
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
MACOS_BROWSERS = ("/Applications/Chromium.app/Contents/MacOS/Chromium",
                  "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome")
DRIVERS = ("chromedriver", "/usr/lib/chromium/chromedriver")
INSTALL_HINT = (
    "browser check: no Chromium or Chrome found (looked for $ACCUMCORE_CHROMIUM, "
    + ", ".join(BROWSERS) + " on PATH): install one with its chromedriver (Debian/Ubuntu: "
    "`sudo apt-get install chromium chromium-driver`; macOS: `brew install --cask chromium "
    "chromedriver`), or skip this one step locally with ACCUMCORE_SKIP_BROWSER=1 (CI never "
    "skips it)"
)
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,1600",
)
PAGE_TIMEOUT_S = 30  # generous: the CI machine is small and shared


def toc_docnames(toc_path: Path) -> list[str]:
    """Docnames in ``_toc.yml`` order: the root, then every ``file`` (parts, chapters, sections)."""
    toc = yaml.safe_load(toc_path.read_text())
    names = [toc["root"]]

    def walk(entries: list | None) -> None:
        for entry in entries or []:
            if "file" in entry:
                names.append(entry["file"])
            walk(entry.get("sections"))

    for part in toc.get("parts") or []:
        walk(part.get("chapters"))
    walk(toc.get("chapters"))
    return [str(Path(n).with_suffix("")) if Path(n).suffix in (".md", ".ipynb") else n
            for n in names]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)  # the browser hung up: harmless


def serve(directory: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """Serve ``directory`` on 127.0.0.1 (a free port) in a daemon thread; returns the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = _QuietServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def colab_template(config_path: Path = ROOT / "_config.yml") -> str:
    """The Colab launch URL of a docname (``{}``), from ``_config.yml``'s ``repository``."""
    repository = yaml.safe_load(config_path.read_text())["repository"]
    slug = repository["url"].rstrip("/").removesuffix(".git").split("github.com/", 1)[1]
    branch = repository.get("branch", "main")
    return f"https://colab.research.google.com/github/{slug}/blob/{branch}/{{}}.ipynb"


def _which(name: str) -> str | None:
    return shutil.which(name) or (name if os.path.isabs(name) and os.access(name, os.X_OK)
                                  else None)


def find_browser() -> tuple[str | None, str | None]:
    """``(browser, chromedriver)`` to use; ``None`` for what was not found."""
    browser = os.environ.get("ACCUMCORE_CHROMIUM") or next(
        (found for name in (*BROWSERS, *MACOS_BROWSERS) if (found := _which(name))), None)
    driver = os.environ.get("ACCUMCORE_CHROMEDRIVER") or next(
        (found for name in DRIVERS if (found := _which(name))), None)
    return browser, driver


def skip_requested() -> bool:
    """``ACCUMCORE_SKIP_BROWSER=1`` outside CI; under ``CI=true`` asking to skip is an error."""
    if os.environ.get("ACCUMCORE_SKIP_BROWSER", "") not in ("", "0"):
        if os.environ.get("CI", "").lower() == "true":
            sys.exit("browser check: ACCUMCORE_SKIP_BROWSER is set, but CI never skips the "
                     "browser check (CI=true): unset it")
        return True
    return False


def install_browser() -> bool:
    """Install Debian's chromium and chromium-driver with apt-get when that is possible (root,
    apt-get on PATH). Returns whether it ran the installation successfully."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("apt-get"):
        return False
    print("browser check: installing Debian's chromium and chromium-driver (apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (["apt-get", "update", "-q"],
                    ["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium",
                     "chromium-driver"]):
        if subprocess.run(command, env=env).returncode != 0:
            return False
    return True


def ensure_browser(install_missing: bool = False) -> tuple[str, str | None]:
    """``find_browser()``; where it finds no browser, or a browser without a chromedriver
    (offline, Selenium Manager cannot download one), Debian's are installed first
    (``install_missing``, where possible), else the run ends with ``INSTALL_HINT``."""
    browser, driver_path = find_browser()
    if (browser is None or driver_path is None) and install_missing and install_browser():
        browser, driver_path = find_browser()
    if browser is None:
        sys.exit(INSTALL_HINT)
    return browser, driver_path


def make_driver(profile: str, install_missing: bool = False) -> webdriver.Chrome:
    browser, driver_path = ensure_browser(install_missing)
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    # With a chromedriver path there is no Selenium Manager lookup; without one, Selenium
    # Manager finds (or downloads) a driver that matches the browser.
    service = Service(driver_path) if driver_path else Service()
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_page_load_timeout(PAGE_TIMEOUT_S)
    driver.set_script_timeout(PAGE_TIMEOUT_S)
    return driver


_WAIT_FOR_MATHJAX = """
const done = arguments[arguments.length - 1];
if (!window.MathJax || !MathJax.startup || !MathJax.startup.promise) { done("no-mathjax"); }
else { MathJax.startup.promise.then(() => done("ok"), (e) => done("error: " + e)); }
"""

_INSPECT = """
const images = Array.from(document.images).map((img) => ({
  src: img.currentSrc || img.src, loading: !img.complete,
  ok: img.complete && img.naturalWidth > 0}));
const math = Array.from(document.querySelectorAll(".math"));
const clone = document.body.cloneNode(true);
clone.querySelectorAll("pre, code, script, style, textarea").forEach((e) => e.remove());
const text = clone.textContent;
const scripts = Array.from(document.scripts).map((s) => s.src).filter((s) => /mathjax/i.test(s));
const colab = Array.from(document.querySelectorAll('a[href*="colab.research.google.com"]'))
    .map((a) => a.href);
const all = document.body.cloneNode(true);
all.querySelectorAll("script, style").forEach((e) => e.remove());
const outputs = Array.from(document.querySelectorAll(".cell_output .output")).map((o) => {
  const cell = o.closest(".cell");
  const tags = cell ? Array.from(cell.classList).filter((c) => c.startsWith("tag_"))
      .map((c) => c.slice(4)) : [];
  return {text: o.textContent, stderr: o.classList.contains("stderr"), tags: tags};
});
return {
  title: document.title,
  images: images,
  mathElements: math.length,
  mathUnrendered: math.filter((m) => !m.querySelector("mjx-container")).length,
  rawTex: text.includes("\\\\[") || text.includes("\\\\("),
  mathjaxScripts: scripts,
  colab: colab,
  prose: text,
  text: all.textContent,
  outputs: outputs,
};
"""


def inspect(driver: webdriver.Chrome) -> dict:
    """Wait for MathJax and images, then return what the page shows."""
    status = driver.execute_async_script(_WAIT_FOR_MATHJAX)
    deadline = time.monotonic() + PAGE_TIMEOUT_S
    info = driver.execute_script(_INSPECT)
    while any(i["loading"] for i in info["images"]) and time.monotonic() < deadline:
        time.sleep(0.25)  # images still loading (a broken image is complete, naturalWidth 0)
        info = driver.execute_script(_INSPECT)
    info["mathjax"] = status
    return info


def machine_paths() -> list[str]:
    """Absolute paths of this machine that a built page must not show (see book_checks)."""
    paths = {str(ROOT), os.path.realpath(ROOT), sys.prefix, os.path.realpath(sys.prefix)}
    home = os.path.expanduser("~")
    if len(Path(home).parts) > 2:  # /home/user, not / or /root (too short to be telling)
        paths.add(home)
    return sorted(paths)


def problems_of(info: dict, docname: str, base: str, notebook: bool) -> list[str]:
    """The checks; an empty list means the page passed."""
    problems = book_checks.page_problems(info, machine_paths())
    title = info["title"] or ""
    if not title.strip() or "404" in title or "error response" in title.lower():
        problems.append(f"bad title {title!r} (missing or error page)")
    for image in info["images"]:
        if not image["ok"]:
            problems.append(f"image did not load: {image['src']}")
    if info["mathElements"] or info["rawTex"]:
        if info["mathjax"] != "ok":
            problems.append(f"page has math but MathJax did not run ({info['mathjax']})")
        if info["mathUnrendered"]:
            problems.append(f"{info['mathUnrendered']} of {info['mathElements']} math elements "
                            "not rendered by MathJax")
        if info["rawTex"]:
            problems.append("raw TeX (\\[ or \\() left in the page text")
        remote = [s for s in info["mathjaxScripts"] if not s.startswith(base)]
        if remote:
            problems.append(f"MathJax loaded from outside the book: {remote}")
    if notebook:
        expected = colab_template().format(docname)
        if expected not in info["colab"]:
            problems.append(f"Colab launch link missing or wrong: expected {expected}, "
                            f"found {info['colab'] or 'none'}")
    return problems


_BREAK_PAGE = """
const img = document.createElement("img");
img.src = "_images/does-not-exist.png";
document.querySelector("main, article, body").appendChild(img);
const p = document.createElement("p");
p.textContent = "\\\\[ B = b \\\\cdot K \\\\]";
document.querySelector("main, article, body").appendChild(p);
document.querySelectorAll('a[href*="colab.research.google.com"]').forEach((a) => a.remove());
const fence = document.createElement("pre");
fence.textContent = "```{admonition} Answer\\n:class: dropdown\\n```";
document.querySelector("main, article, body").appendChild(fence);
const cell = document.createElement("div");
cell.className = "cell docutils container";
cell.innerHTML = '<div class="cell_output docutils container">' +
    '<div class="output stderr"><pre></pre></div></div>';
cell.querySelector("pre").textContent = arguments[0] +
    "/accumcore/_impl/accum_model.py:440: UserWarning: a warning the page does not expect";
document.querySelector("main, article, body").appendChild(cell);
"""


def negative_control(driver: webdriver.Chrome, base: str, docname: str) -> list[str]:
    """Break a notebook page in the browser; every check must notice. Returns failures."""
    driver.get(f"{base}/{docname}.html")
    driver.execute_async_script(_WAIT_FOR_MATHJAX)
    driver.execute_script(_BREAK_PAGE, str(ROOT))
    found = " | ".join(problems_of(inspect(driver), docname, base, notebook=True))
    expected = {"broken image": "image did not load", "raw TeX": "raw TeX",
                "missing Colab link": "Colab launch link missing",
                "unrendered directive": "unrendered directive fence",
                "machine path": "absolute path of the building machine",
                "stderr output": "stderr output in a cell not tagged expect-warning"}
    return [f"negative control: the {name} check did not fire" for name, marker in
            expected.items() if marker not in found]


REFERENCE_PREFIX = "book/reference/"  # the Reference pages: tables of behaviours and tests

_TABLE_WIDTHS = """
return Array.from(document.querySelectorAll(".ref-table table")).map((t) => ({
  container: t.parentElement.clientWidth, table: t.scrollWidth}));
"""


def reference_problems(driver: webdriver.Chrome) -> list[str]:
    """On a Reference page: each ``ref-table`` table fits the page (no sideways scrolling).
    (tests/test_docs_links.py checks that every table of these pages is one.)"""
    widths = driver.execute_script(_TABLE_WIDTHS)
    return [f"table {i + 1} is {w['table']} px wide in {w['container']} px: it scrolls sideways"
            for i, w in enumerate(widths) if w["table"] > w["container"] + 1]


_WIDEN_TABLE = """
const cell = document.querySelector(".ref-table td");
const wide = document.createElement("span");
wide.style.whiteSpace = "nowrap";
wide.textContent = "x".repeat(400);
cell.appendChild(wide);
"""


def reference_negative_control(driver: webdriver.Chrome, base: str, docname: str) -> list[str]:
    """Widen a Reference page's table in the browser: the width check must notice."""
    driver.get(f"{base}/{docname}.html")
    if not driver.execute_script(_TABLE_WIDTHS):
        return [f"negative control: {docname} has no `ref-table` table to widen"]
    if reference_problems(driver):
        return []  # the real page fails already; the page loop reports it
    driver.execute_script(_WIDEN_TABLE)
    return [] if reference_problems(driver) else [
        "negative control: the Reference table width check did not fire"]


SCREEN_PX = 900  # one screen of the length measure (a laptop's window)


def print_screens(driver: webdriver.Chrome, base: str, docnames: list[str]) -> float:
    """Print each page's length in screens (its height at 1400 px wide over a 900 px window)
    and the total; returns the total."""
    driver.set_window_size(1400, 900)
    total = 0.0
    for docname in docnames:
        driver.get(f"{base}/{docname}.html")
        inspect(driver)
        height, inner = driver.execute_script(
            "return [document.documentElement.scrollHeight, window.innerHeight];")
        screens = height / SCREEN_PX
        total += screens
        print(f"screens {screens:6.2f}  {docname}")
    print(f"screens {total:5.1f}  in all ({len(docnames)} pages, {SCREEN_PX} px screens at "
          f"1400 px wide; the window showed {inner} px)")
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--html", type=Path, default=ROOT / "_build" / "html")
    parser.add_argument("--toc", type=Path, default=ROOT / "_toc.yml")
    parser.add_argument("--install-missing", action="store_true",
                        help="no browser found: install Debian's with apt-get if possible")
    parser.add_argument("--install-only", action="store_true",
                        help="only make sure a browser is there, installed as with "
                             "--install-missing, and exit (scripts/test.sh runs this in the "
                             "background while the unit tests run)")
    parser.add_argument("--screens", action="store_true",
                        help="also print each page's length in screens of 900 px at 1400 px "
                             "wide, and the total (what a reader scrolls through)")
    parser.add_argument("--screenshot", type=Path, help="save a screenshot of one page here")
    parser.add_argument("--screenshot-page", default=None,
                        help="docname to screenshot (default: the first notebook page)")
    args = parser.parse_args()

    if skip_requested():
        print("browser check: skipped (ACCUMCORE_SKIP_BROWSER is set; CI never skips it)")
        return 0
    if args.install_only:
        browser, driver_path = ensure_browser(install_missing=True)
        print(f"browser check: browser {browser}, driver {driver_path or '(Selenium Manager)'}")
        return 0
    if not (args.html / "index.html").is_file():
        sys.exit(f"browser_check: no built book in {args.html}: run jupyter-book build first")
    docnames = toc_docnames(args.toc)
    notebooks = {d for d in docnames if (ROOT / f"{d}.ipynb").is_file()}
    server, base = serve(args.html)
    profile = tempfile.mkdtemp(prefix="browser-check-profile-")
    driver = make_driver(profile, install_missing=args.install_missing)
    failures: list[str] = []
    try:
        first_notebook = next((d for d in docnames if d in notebooks), None)
        if first_notebook is None:
            failures.append("no notebook page in _toc.yml: the Colab check cannot be tested")
        else:
            failures += negative_control(driver, base, first_notebook)
        references = [d for d in docnames if d.startswith(REFERENCE_PREFIX)]
        if references:
            failures += reference_negative_control(driver, base, references[0])
        for docname in docnames:
            url = f"{base}/{docname}.html"
            try:
                with urllib.request.urlopen(url, timeout=PAGE_TIMEOUT_S) as response:
                    status = response.status
            except urllib.error.HTTPError as err:
                status = err.code
            if status != 200:
                failures.append(f"{docname}: HTTP {status} for {url}")
                continue
            start = time.monotonic()
            driver.get(url)
            info = inspect(driver)
            problems = problems_of(info, docname, base, docname in notebooks)
            if docname.startswith(REFERENCE_PREFIX):
                problems += reference_problems(driver)
            failures += [f"{docname}: {p}" for p in problems]
            kind = "notebook" if docname in notebooks else "page"
            print(f"{'FAIL' if problems else 'ok  '} {docname} ({kind}; "
                  f"{len(info['images'])} images, {info['mathElements']} math elements, "
                  f"{len(info['colab'])} Colab links; {time.monotonic() - start:.1f} s)")
        if args.screens:
            print_screens(driver, base, docnames)
        if args.screenshot:
            page = args.screenshot_page or first_notebook or docnames[0]
            driver.get(f"{base}/{page}.html")
            inspect(driver)
            driver.save_screenshot(str(args.screenshot))
            print(f"screenshot of {page} -> {args.screenshot}")
    finally:
        driver.quit()
        server.shutdown()
        shutil.rmtree(profile, ignore_errors=True)
    for failure in failures:
        print("FAIL", failure)
    print(f"browser check: {len(docnames)} pages, "
          f"{'all passed' if not failures else f'{len(failures)} problem(s)'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
