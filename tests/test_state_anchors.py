"""Prefix reuse for models with recurrent state: the anchors where the scheduler saves a state
(cache/state_anchors.py), and an agent session on a tiny Qwen3-Next through the engine: an
appended turn resumes at the previous prompt's end, an edit inside an earlier message resumes at
that message's start, a tight budget evicts; every output equals the engine's without reuse, to
the log-probabilities of its tokens (a resumed state that is wrong moves them far more than its
tokens: a zeroed state at position 48 here moves the logits by about a tenth)."""

from __future__ import annotations

import anyio
import pytest

from freetoken.cache.state_anchors import AnchorIndex, prefix_digests
from freetoken.config import EngineConfig, SamplingParams, SchedulerConfig
from freetoken.engine.llm import AsyncLLM
from freetoken.loader.synth import write_synthetic_checkpoint

STEPS = 6


def test_positions_are_page_floors_of_message_starts_and_of_the_last_prompt_token():
    index = AnchorIndex(page_size=4, anchor_ids=frozenset({99}), snapshot_bytes=10, budget_bytes=100)
    prompt = [1, 2, 3, 4, 5, 99, 7, 8, 9, 10, 99, 12, 13, 14]  # 99 at 5 and 10; the last token at 13
    assert index.positions(prompt) == [4, 8, 12]
    assert index.positions([99, 1, 2]) == []  # a message start at 0, and a last token in the first page


def test_an_anchor_ending_a_short_chunk_is_passed_over_but_the_prompts_last():
    index = AnchorIndex(4, frozenset(), snapshot_bytes=10, budget_bytes=100, min_gap=16)
    ahead = [20, 28, 60, 100, 104]
    assert index.chunk_end(ahead, 16, 48) == (48, False)  # 20 and 28 are too close to 16; 60 lies past 48
    assert ahead == [60, 100, 104]
    assert index.chunk_end(ahead, 48, 80) == (80, False)  # 60 is 12 from 48
    assert index.chunk_end(ahead, 80, 112) == (100, True)
    assert index.chunk_end(ahead, 100, 112) == (104, True)  # the prompt's last, however close
    assert ahead == [] and index.chunk_end(ahead, 104, 110) == (110, False)
    assert AnchorIndex(4, frozenset(), 10, 100).chunk_end([5, 9], 4, 20) == (5, True)  # min_gap 0: every one
    with pytest.raises(ValueError, match="minimum gap"):
        AnchorIndex(4, frozenset(), 10, 100, min_gap=-1)


def test_digests_name_prefixes_and_the_deepest_kept_one_is_found():
    tokens = list(range(20))
    digests = prefix_digests(tokens, 4, len(tokens))
    assert sorted(digests) == [4, 8, 12, 16, 20]
    assert prefix_digests(tokens[:8] + [0] * 12, 4, 20)[8] == digests[8]  # a prefix's digest is its own
    assert prefix_digests(tokens[:8] + [0] * 12, 4, 20)[12] != digests[12]
    index = AnchorIndex(4, frozenset(), snapshot_bytes=10, budget_bytes=100)
    for n in (4, 12):
        index.add(digests[n])
    assert index.deepest(digests, 20) == 12
    assert index.deepest(digests, 11) == 4
    assert index.deepest(digests, 3) == 0


def test_the_budget_evicts_the_least_recently_used():
    index = AnchorIndex(4, frozenset(), snapshot_bytes=10, budget_bytes=25)  # room for two
    assert index.capacity == 2
    assert index.add(b"a") == [] and index.add(b"b") == []
    index.deepest({4: b"a"}, 4)  # a used again: b is now the oldest
    assert index.add(b"c") == [b"b"]
    assert b"a" in index and b"c" in index and len(index) == 2
    assert AnchorIndex(4, frozenset(), snapshot_bytes=10, budget_bytes=5).add(b"x") == [b"x"]  # no room at all


def test_an_anchor_a_sequence_will_resume_from_is_not_evicted():
    index = AnchorIndex(4, frozenset(), snapshot_bytes=10, budget_bytes=10)  # room for one
    index.add(b"a")
    index.hold(b"a")  # admitted, its first chunk not run yet
    assert index.add(b"b") == []  # over budget while a is held
    assert b"a" in index and b"b" in index
    index.unhold(b"a")
    assert index.add(b"c") == [b"a", b"b"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next", "tiny", seed=5,
                                      dtype="float32")


def _session(model_dir, prompts: list[list[int]], reuse: bool, anchor_gb: float = 1.0, min_gap: int = 0,
             chunk: int = 24) -> list[tuple[list, int]]:
    """Each prompt in turn through one engine: ([(greedy token, its logprob)], cached tokens) per prompt.
    (min_gap 0: a state at every anchor, whatever the chunk it ends.)"""
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=256,
                          scheduler=SchedulerConfig(prefill_chunk=chunk, prefix_reuse=reuse, state_anchor_gb=anchor_gb,
                                                    anchor_min_gap=min_gap))
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=0)

    async def main():
        out = []
        async with AsyncLLM.start(config) as llm:
            for i, prompt in enumerate(prompts):
                chunks = [c async for c in llm.generate(prompt, params, f"turn-{i}")]
                out.append(([(lp.token_id, lp.logprob) for c in chunks for lp in c.logprobs], chunks[-1].cached_tokens))
        return out

    return anyio.run(main)


def _same_outputs(warm, cold) -> None:
    for (ours, _), (theirs, _) in zip(warm, cold, strict=True):
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        assert [lp for _, lp in ours] == pytest.approx([lp for _, lp in theirs], abs=1e-4)


def _im_start(model_dir) -> int:
    from freetoken.loader.tokenizer import Tokenizer

    token = Tokenizer.from_dir(model_dir).token_to_id("<|im_start|>")
    assert token is not None
    return token


def test_an_agent_session_resumes_at_anchors_and_computes_what_a_cold_engine_does(model_dir):
    m = _im_start(model_dir)
    system = [m] + list(range(100, 139))  # a message of 40 tokens
    user = [m] + list(range(300, 321))  # it starts at 40
    first = system + user  # 62 tokens: anchors at 32 (the user message's page), 48 (the last token's)
    reply = [t for t, _ in _session(model_dir, [first], reuse=True)[0][0]]
    second = first + reply + [m] + list(range(500, 530))  # a tool result appended
    edited = system[:20] + [999] + system[21:] + user  # an edit inside the first message, at 20
    turns = [first, second, edited]
    warm = _session(model_dir, turns, reuse=True)
    cold = _session(model_dir, turns, reuse=False)
    _same_outputs(warm, cold)
    assert [cached for _, cached in cold] == [0, 0, 0]
    # the appended turn resumes at the first prompt's last anchor; the edit at 20 from the start
    # (no anchor before it: the first message starts at 0)
    assert [cached for _, cached in warm] == [0, 48, 0]


def test_an_edit_resumes_at_the_start_of_the_message_it_changes(model_dir):
    m = _im_start(model_dir)
    messages = [[m] + list(range(100 + 40 * i, 133 + 40 * i)) for i in range(4)]  # 4 messages of 34 tokens
    first = [t for msg in messages for t in msg]  # message starts at 0, 34, 68, 102
    edited = first[:80] + [7] + first[81:]  # inside the third message (68..101)
    warm = _session(model_dir, [first, edited], reuse=True)
    cold = _session(model_dir, [first, edited], reuse=False)
    _same_outputs(warm, cold)
    assert warm[1][1] == 64  # the page boundary at or before the third message's start (68)


def test_a_budget_for_one_state_still_resumes_from_the_newest(model_dir):
    m = _im_start(model_dir)
    first = [m] + list(range(100, 160))  # one message, 61 tokens: one anchor at 48
    second = [m] + list(range(200, 260))
    prompts = [first, second, second + [5, 6], first + [5, 6]]
    warm = _session(model_dir, prompts, reuse=True, anchor_gb=1e-9)  # too little for a single state
    assert [cached for _, cached in warm] == [0, 0, 0, 0]
    snapshot_gb = _state_gb(model_dir)
    warm = _session(model_dir, prompts, reuse=True, anchor_gb=1.5 * snapshot_gb)  # room for one
    cold = _session(model_dir, prompts, reuse=False)
    _same_outputs(warm, cold)
    # the third resumes from the second's state; the fourth's (the first's) was evicted for it
    assert [cached for _, cached in warm] == [0, 0, 48, 0]


def test_an_appended_turns_anchors_close_to_its_start_cost_no_forward_of_their_own(model_dir, monkeypatch):
    """A tool call's message start a few tokens after the resume point (48; its anchor at 64): with
    the minimum gap it ends no chunk (one forward to the prompt's last anchor, 144, instead of two),
    the next turn still resumes at the prompt's end, and the outputs equal the cold engine's."""
    from freetoken.engine.model_runner import ModelRunner

    m = _im_start(model_dir)
    first = [m] + list(range(100, 160))  # 61 tokens: the prompt's last anchor at 48
    second = first + [m, 5, 6, 7, m, 8, 9] + list(range(300, 390))  # message starts at 61, 65: 158 tokens
    third = second + [m] + list(range(400, 420))
    forwards: list[int] = []
    prefill = ModelRunner.prefill

    def counted(self, pages, token_ids, *args, **kwargs):
        forwards.append(len(token_ids))
        return prefill(self, pages, token_ids, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "prefill", counted)
    turns = [first, second, third]
    for min_gap, chunks in ((0, [48, 13, 16, 80, 14, 32, 3]), (32, [48, 13, 96, 14, 32, 3])):
        forwards.clear()
        warm = _session(model_dir, turns, reuse=True, min_gap=min_gap, chunk=256)
        assert [cached for _, cached in warm] == [0, 48, 144], min_gap  # each resumes at the last prompt's end
        assert forwards == chunks, min_gap
    _same_outputs(warm, _session(model_dir, turns, reuse=False, chunk=256))


def _state_gb(model_dir) -> float:
    from freetoken.engine.model_runner import ModelRunner

    runner = ModelRunner(str(model_dir), EngineConfig(device="cpu", dtype="float32", max_model_len=64), rows=1)
    try:
        return runner.states.slot_bytes / 2**30
    finally:
        runner.close()
