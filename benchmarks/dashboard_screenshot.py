"""Screenshot a freetoken dashboard, live or replayed, with the browser set-up of the browser tests.

    python benchmarks/dashboard_screenshot.py http://127.0.0.1:8000/dashboard docs/dashboard.png [--wait 10]
    python benchmarks/dashboard_screenshot.py --replay run.jsonl docs/dashboard.png [--speed 10]

Live, it starts nothing: point it at a server that is already serving (under load, for a telling
picture). `--replay` takes a recording made by benchmarks/dashboard_record.py (on a machine with
no browser), serves it to the packaged page locally (benchmarks/dashboard_replay.py) and takes the
picture once the page has drawn the recording's last event. Debian's chromium, headless, a fresh
profile; playwright downloads no browser.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.dashboard_replay import ReplayServer, load_recording  # noqa: E402
from tests.browser.chromium import chromium_context  # noqa: E402

LIVE = "() => document.getElementById('conn').textContent === 'live'"


def shoot(url: str, out: Path, *, wait_s: float, api_key: str | None = None, width: int = 1300,
          height: int = 1000, drawn=None) -> None:
    """Open `url`, wait for the stream, then `drawn(page)` (if given) and `wait_s`; write the PNG."""
    with chromium_context(viewport={"width": width, "height": height}) as context:
        page = context.new_page()
        page.goto(url)
        if api_key:
            page.fill("#api-key", api_key)
        page.wait_for_function(LIVE, timeout=60_000)
        if drawn is not None:
            drawn(page)
        page.wait_for_timeout(wait_s * 1000)
        page.screenshot(path=str(out), full_page=True)


def replay_shot(recording_path: Path, out: Path, *, speed: float, width: int = 1300, height: int = 1000,
                timeout_s: float = 300.0, check=None) -> dict:
    """Screenshot the replay of a recording once the page shows its last event (then `check(page)`,
    if given, e.g. a test's); returns that event."""
    recording = load_recording(recording_path)
    total, last = len(recording.events), recording.events[-1][1]
    tokens = last["metrics"]["counters"].get("generation_tokens_total", 0)

    def drawn(page) -> None:
        # every recorded event sent, then the page's own code shows the last one's numbers
        deadline = time.monotonic() + timeout_s
        while server.events_sent < total:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replay sent {server.events_sent}/{total} events in {timeout_s} s")
            page.wait_for_timeout(100)
        page.wait_for_function(f"() => Number(document.getElementById('gen-tokens').textContent) === {tokens}",
                               timeout=timeout_s * 1000)
        if check is not None:
            check(page)

    with ReplayServer(recording, speed=speed) as server:
        shoot(f"{server.url}/dashboard", out, wait_s=0.5, width=width, height=height, drawn=drawn)
    return last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", nargs="+", help="URL OUT.png, or with --replay just OUT.png")
    parser.add_argument("--replay", type=Path, help="a recording (benchmarks/dashboard_record.py) to replay")
    parser.add_argument("--speed", type=float, default=10.0, help="replay this many times faster than recorded")
    parser.add_argument("--wait", type=float, default=10.0, help="live: seconds of data to draw first")
    parser.add_argument("--api-key", help="live: the server's API key, typed into the page")
    parser.add_argument("--width", type=int, default=1300)
    parser.add_argument("--height", type=int, default=1000)
    args = parser.parse_args()
    if len(args.target) != (1 if args.replay else 2):
        parser.error("give URL OUT.png, or --replay FILE.jsonl OUT.png")
    out = Path(args.target[-1])
    if args.replay:
        replay_shot(args.replay, out, speed=args.speed, width=args.width, height=args.height)
    else:
        shoot(args.target[0], out, wait_s=args.wait, api_key=args.api_key, width=args.width, height=args.height)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
