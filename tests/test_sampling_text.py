"""Sampler filters and incremental detokenisation with stop strings."""

from __future__ import annotations

import pytest
import torch

from freetoken.config import SamplingParams
from freetoken.engine.detokenizer import IncrementalText
from freetoken.engine.sampler import Sampler, filter_logits
from freetoken.errors import RequestError


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    kept = torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0))
    assert kept.tolist() == [False, True, False, True, False]


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert torch.isfinite(filter_logits(logits, 0, 0.5)).tolist() == [True, False, False, False]
    assert torch.isfinite(filter_logits(logits, 0, 0.79)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, 0, 0.81)).tolist() == [True, True, True, False]


def test_seeded_sampling_is_reproducible_and_independent_of_batch():
    sampler = Sampler("cpu")
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=42)
    alone = [sampler.sample(logits[:1], [p], [sampler.generator_for(p)])[0].token for _ in range(2)]
    gens = [sampler.generator_for(p), None, None]
    batched = [s.token for s in sampler.sample(
        logits, [p, SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)], gens)]
    assert alone[0] == alone[1] == batched[0]
    assert batched[2] == int(logits[2].argmax())


def test_greedy_is_argmax():
    sampler = Sampler("cpu")
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=0.0)
    assert [s.token for s in sampler.sample(logits, [p] * 4, [None] * 4)] == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=0),
        SamplingParams(temperature=-1),
        SamplingParams(temperature=float("nan")),
        SamplingParams(top_p=0.0),
        SamplingParams(top_k=-3),
        SamplingParams(stop=("",)),
    ],
)
def test_invalid_params_are_rejected(params):
    with pytest.raises(RequestError):
        params.validate()


class CharDecoder:
    """Token i is the i-th character of a fixed alphabet; 99 and 100 are the two halves of 'é'."""

    alphabet = "abcdefghij XYZ"

    def decode(self, ids, skip_special_tokens=True):
        raw = b"".join(
            self.alphabet[i].encode() if i < len(self.alphabet) else {99: b"\xc3", 100: b"\xa9"}[i] for i in ids
        )
        return raw.decode("utf-8", errors="replace")


def _run(tokens, stop=()):
    text = IncrementalText(CharDecoder(), stop)
    out = []
    for t in tokens:
        out.append(text.add(t))
        if text.stopped:
            break
    out.append(text.flush())
    return "".join(out), text.stopped, out


def test_text_streams_whole_characters_only():
    full, stopped, pieces = _run([0, 99, 100, 1])
    assert full == "aéb" and not stopped
    assert pieces[1] == ""  # half a character is held back


def test_stop_string_spanning_tokens_is_cut():
    full, stopped, _ = _run([0, 1, 11, 12, 13, 2], stop=("XYZ",))
    assert stopped and full == "ab"


def test_held_back_prefix_released_when_not_a_stop():
    full, stopped, pieces = _run([0, 11, 12, 2], stop=("XYZ",))
    assert not stopped and full == "aXYc"
    assert pieces[1] == ""  # "X" could have started the stop string


def test_logprobs_are_log_softmax_of_raw_logits():
    sampler = Sampler("cpu")
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(3))
    out = sampler.sample(logits, [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0)],
                         [None, None])
    ref = torch.log_softmax(logits[0], -1)
    lp = out[0].logprob
    assert lp.token_id == out[0].token and abs(lp.logprob - float(ref.max())) < 1e-6
    assert [t for t, _ in lp.top] == torch.topk(ref, 3).indices.tolist()
    assert out[1].logprob is None


def test_extreme_parameters_never_break_the_sampler():
    """A temperature that overflows fp32 samples greedily; a top_p below float resolution keeps the top token."""
    sampler = Sampler("cpu")
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(4))
    best = int(logits.argmax())
    assert sampler.sample(logits, [SamplingParams(temperature=1e-39)], [None])[0].token == best
    out = sampler.sample(logits, [SamplingParams(temperature=1.0, top_p=1e-50)], [None])[0]
    assert out.token == best and out.error is None
    bad = sampler.sample(torch.full((1, 50), float("nan")), [SamplingParams(temperature=1.0)], [None])[0]
    assert bad.token == -1 and "non-finite" in bad.error


def test_incremental_text_keeps_sentencepiece_leading_spaces():
    """Decoders that strip a sequence's first leading space (Metaspace) still see context."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "\u2581hello": 1, "\u2581world": 2, "!": 3, "\u2581how": 4, "\u2581are": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    ids = [1, 2, 3, 4, 5, 2]
    text = IncrementalText(tok)
    out = "".join(text.add(i) for i in ids) + text.flush()
    assert out == tok.decode(ids) == "hello world! how are world"
