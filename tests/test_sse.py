"""SSE data lines stay one line for clients that split with Unicode's line rules."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from freetoken.server.sse import json_data


@given(st.text(alphabet=st.sampled_from(["a", "\u0085", "\u2028", "\u2029", "\n", "\r", "\x1c", "\x0b", "é"]),
               max_size=40))
def test_an_event_is_one_line_by_every_splitting_rule_and_decodes_to_its_value(text):
    value = {"choices": [{"delta": {"content": text}}]}
    line = ("data: " + json_data(value).decode()).splitlines()  # the widest rule: Python's
    assert len(line) == 1
    assert json.loads(line[0][len("data: "):]) == value


def test_only_the_three_line_breakers_are_escaped():
    assert json_data("a\u2028b\u0085c\u2029") == b'"a\\u2028b\\u0085c\\u2029"'
    assert json_data("naïve") == '"naïve"'.encode()
