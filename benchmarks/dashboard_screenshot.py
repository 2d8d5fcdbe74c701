"""Screenshot a running freetoken dashboard with the browser set-up of the browser tests.

    python benchmarks/dashboard_screenshot.py http://127.0.0.1:8000/dashboard docs/dashboard.png [--wait 10]

It starts nothing: point it at a server that is already serving (under load, for a telling
picture). Debian's chromium, headless, a fresh profile; playwright downloads no browser.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.browser.chromium import chromium_context  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="the dashboard's URL, e.g. http://127.0.0.1:8000/dashboard")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--wait", type=float, default=10.0, help="seconds of live data to draw first")
    parser.add_argument("--api-key", help="the server's API key, typed into the page")
    parser.add_argument("--width", type=int, default=1300)
    parser.add_argument("--height", type=int, default=1000)
    args = parser.parse_args()
    with chromium_context(viewport={"width": args.width, "height": args.height}) as context:
        page = context.new_page()
        page.goto(args.url)
        if args.api_key:
            page.fill("#api-key", args.api_key)
        page.wait_for_function("() => document.getElementById('conn').textContent === 'live'", timeout=60_000)
        page.wait_for_timeout(args.wait * 1000)
        page.screenshot(path=str(args.out), full_page=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
