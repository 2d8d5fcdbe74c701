"""freetoken/progress.py: plain lines off a terminal, a tqdm bar on one, silence when quiet."""

import io

import pytest

from freetoken.progress import Progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(stream, total=40, **kwargs) -> str:
    with Progress("synth", total, unit="tensors", stream=stream, **kwargs) as progress:
        for i in range(total):
            progress.advance(1, f"t{i}")
    return stream.getvalue()


def test_plain_lines_off_a_terminal():
    out = _run(io.StringIO())
    lines = out.splitlines()
    assert "\r" not in out
    assert lines[0] == "synth: started, 40 tensors to go"
    assert lines[-1].startswith("synth: done, 40 tensors in ") and lines[-1].endswith(" s")
    steps = lines[1:-1]
    assert len(steps) == 9  # every tenth of the way, the last one left to the done line
    assert steps[0].startswith("synth: 4/40 tensors (10%) t3 [")


def test_plain_lines_also_after_a_quiet_stretch():
    stream = io.StringIO()
    with Progress("read experts", 1000, unit="layers", stream=stream, interval_s=0.0) as progress:
        progress.advance(1, "layer 0")  # far from the first tenth, but the interval has passed
    assert "read experts: 1/1000 layers (0%) layer 0" in stream.getvalue()


def test_quiet_prints_nothing_on_either_stream():
    assert _run(io.StringIO(), quiet=True) == ""
    assert _run(FakeTerminal(), quiet=True) == ""


def test_a_terminal_gets_a_tqdm_bar_and_no_plain_lines():
    out = _run(FakeTerminal())
    assert "\r" in out and "40/40" in out and "|" in out
    assert "started" not in out and "done" not in out


def test_write_goes_above_the_bar_or_as_a_plain_line():
    for stream in (io.StringIO(), FakeTerminal()):
        with Progress("bench decode", 2, unit="runs", stream=stream) as progress:
            progress.write("[bench] lru 12.3 tok/s")
            progress.advance(2)
        assert "[bench] lru 12.3 tok/s\n" in stream.getvalue()


def test_a_failure_is_reported_as_such():
    stream = io.StringIO()
    with pytest.raises(OSError), Progress("synth weights", 10, unit="B", stream=stream) as progress:
        progress.advance(3)
        raise OSError("disk full")
    assert "synth weights: stopped by OSError" in stream.getvalue().splitlines()[-1]


def test_negative_total_is_refused():
    with pytest.raises(ValueError, match="'synth'"):
        Progress("synth", -1)
