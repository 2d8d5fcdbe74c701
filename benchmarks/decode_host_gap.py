"""`bench decode` with the host idle for GAP seconds before each decode step, outside the step's
timing: what a server's scheduler leaves between steps (HTTP streaming, admission, sampling of
other requests), which a back-to-back benchmark does not show.

    python benchmarks/decode_host_gap.py GAP bench decode --model M ... --out F.json

The results file is `bench decode`'s, with `host_gap_s` and this command added.
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    gap = float(argv[0])
    if gap < 0:
        print(f"the gap must be >= 0 seconds, got {gap}", file=sys.stderr)
        return 2
    from freetoken.__main__ import main as freetoken_main
    from freetoken.engine.model_runner import ModelRunner

    set_context = ModelRunner.set_context

    def idle_then_set_context(self, requests, phase, steps):
        if phase == "decode" and gap > 0:  # before the bench starts the step's timing
            time.sleep(gap)
        return set_context(self, requests, phase, steps)

    ModelRunner.set_context = idle_then_set_context
    try:
        rc = freetoken_main(argv[1:])
    finally:
        ModelRunner.set_context = set_context
    out = argv[argv.index("--out") + 1] if "--out" in argv else None
    if rc == 0 and out:
        with open(out) as f:
            doc = json.load(f)
        doc["host_gap_s"] = gap
        doc["command"] = "python benchmarks/decode_host_gap.py " + " ".join(argv)
        with open(out, "w") as f:
            json.dump(doc, f, indent=2)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
