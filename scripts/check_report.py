"""Open a training report (``report.html``, from ``ficco_select.train.report.write_report``) in headless
Chromium and check that it renders: the title and the section headings ``write_report``
always writes are there, every ``<img>`` has loaded (``naturalWidth > 0``), and the page
logs no console error and raises no JavaScript error. Saves a full-page screenshot.

    python scripts/check_report.py out/pipeline/report.html [--screenshot docs/report.png] [--json]

Exits 0 when every check passes, else 1 with one line per failed check. Needs Playwright
for Python (``pip install -e '.[browser]'``) and a Chromium at ``/usr/bin/chromium``
(Debian: ``apt-get install chromium``; ``--chromium`` names another); Playwright's own
browser download is not used.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Playwright starts Chromium with a fresh temporary profile (--user-data-dir) of its own.
TITLE = "ficco-select report"
HEADINGS = ("hold-out", "Where each schedule family wins", "ficco adapt's learning curve")
"""Text that some <h1>/<h2> of every report contains (``write_report``: one section per split,
the best-schedule map, the learning-curve section)."""
WIDTH = 1200


def check_report(report: str | Path, screenshot: str | Path | None = None, chromium: str = CHROMIUM) -> dict:
    """Load `report` in headless Chromium and check it; ``failures`` (a list of messages) is
    empty when every check passed. Writes a full-page PNG to `screenshot` when given."""
    from playwright.sync_api import sync_playwright

    report = Path(report).resolve()
    console_errors: list[str] = []
    page_errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": WIDTH, "height": 900})
            page.on("console", lambda msg: console_errors.append(msg.text) if msg.type == "error" else None)
            page.on("pageerror", lambda exc: page_errors.append(str(exc)))
            page.goto(report.as_uri(), wait_until="load")
            title = page.title()
            headings = page.eval_on_selector_all("h1, h2, h3", "els => els.map(e => e.textContent)")
            images = page.eval_on_selector_all(
                "img", "els => els.map((e, i) => ({index: i, loaded: e.complete && e.naturalWidth > 0,"
                       " src: (e.getAttribute('src') || '').slice(0, 60)}))")
            h1 = page.locator("h1").count()
            tables = page.locator("table").count()
            width = page.evaluate("document.documentElement.scrollWidth")  # > WIDTH: something overflows
            if screenshot is not None:
                Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()

    failures = []
    if title != TITLE:
        failures.append(f"title: expected {TITLE!r}, got {title!r}")
    if not h1:
        failures.append("headings: the page has no <h1>")
    for text in HEADINGS:
        if not any(text in h for h in headings):
            failures.append(f"headings: none contains {text!r}")
    if not images:
        failures.append("images: the page has no <img>")
    for img in images:
        if not img["loaded"]:
            failures.append(f"images: <img> #{img['index']} did not load (src {img['src']!r}...)")
    failures += [f"console error: {text}" for text in console_errors]
    failures += [f"page error: {text}" for text in page_errors]
    return {"report": str(report), "ok": not failures, "failures": failures, "title": title,
            "headings": len(headings), "tables": tables, "width": width, "images": len(images),
            "images_loaded": sum(img["loaded"] for img in images), "console_errors": console_errors,
            "page_errors": page_errors, "screenshot": None if screenshot is None else str(screenshot)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="the report.html to check")
    parser.add_argument("--screenshot", default="docs/report.png",
                        help="full-page PNG to write (default: %(default)s)")
    parser.add_argument("--chromium", default=CHROMIUM, help="the Chromium binary (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    if not Path(args.report).is_file():
        parser.error(f"no such file: {args.report}")
    result = check_report(args.report, args.screenshot, args.chromium)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        r = result
        print(f"{r['report']}: title {r['title']!r}, {r['headings']} headings, {r['tables']} tables, "
              f"{r['width']} px wide, {r['images_loaded']}/{r['images']} images loaded, "
              f"{len(r['console_errors'])} console errors, {len(r['page_errors'])} page errors; "
              f"screenshot {r['screenshot']}")
        print("OK" if result["ok"] else "FAILED:\n  " + "\n  ".join(result["failures"]))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
