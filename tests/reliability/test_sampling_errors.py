"""Non-finite logits fail their own sequence on every sampling path (greedy included), the rest
of the batch unaffected and the engine serving on; unseeded sampling differs between engine
starts while a given seed reproduces."""

from __future__ import annotations

import json
import shutil

import anyio
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken.config import EngineConfig, SamplingParams
from freetoken.engine.llm import AsyncLLM
from freetoken.engine.sampler import NON_FINITE_LOGITS, Sampler
from freetoken.errors import RequestError
from tests.server_harness import running_server

V = 64
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11)
BAD_ROWS = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
# the sampler runs on the device of the logits: on a CUDA machine both paths are checked
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
POISON_TEXT = "#"  # its one token's embedding row is NaN in the poisoned checkpoint


def healthy_logits(rows: int, device: str) -> torch.Tensor:
    return (torch.randn(rows, V, generator=torch.Generator().manual_seed(3)) * 3).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", list(BAD_ROWS))
@pytest.mark.parametrize("bad_params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_non_finite_row_fails_alone(bad, bad_params, device):
    """Row 1 holds one non-finite logit; rows 0 (greedy) and 2 (sampled) get what they get alone."""
    sampler = Sampler(device)
    logits = healthy_logits(3, device)
    logits[1, 7] = BAD_ROWS[bad]
    params = [GREEDY, bad_params, SAMPLED]
    out = sampler.sample(logits, params, [sampler.generator_for(p) for p in params])
    assert out[1].token == -1 and out[1].error == NON_FINITE_LOGITS
    assert out[0].error is None and out[0].token == int(logits[0].argmax())
    alone = sampler.sample(logits[2:], [SAMPLED], [sampler.generator_for(SAMPLED)])[0]
    assert out[2].error is None and out[2].token == alone.token


@pytest.mark.parametrize("device", DEVICES)
def test_an_all_greedy_batch_checks_every_row(device):
    sampler = Sampler(device)
    logits = healthy_logits(4, device)
    logits[2] = float("nan")
    out = sampler.sample(logits, [GREEDY] * 4, [None] * 4)
    assert [s.error is None for s in out] == [True, True, False, True]
    assert [s.token for s in out] == [*logits[:2].argmax(-1).tolist(), -1, int(logits[3].argmax())]


@pytest.mark.parametrize("device", DEVICES)
def test_a_given_seed_reproduces_across_samplers(device):
    """Two samplers stand for two starts of the engine."""
    logits = torch.zeros(1, 1000, device=device)  # uniform: every draw is up to the generator
    params = SamplingParams(temperature=1.0, seed=1234)

    def draw(sampler: Sampler) -> list[int]:
        gen = sampler.generator_for(params)
        return [sampler.sample(logits, [params], [gen])[0].token for _ in range(16)]

    assert draw(Sampler(device)) == draw(Sampler(device))


@pytest.mark.parametrize("device", DEVICES)
def test_unseeded_requests_differ_across_samplers_and_requests(device):
    """Without a seed each request draws its own from OS entropy: not the same stream after a
    restart, nor for two requests of one run (16 uniform draws over 1000 tokens collide with
    probability 1e-48)."""
    logits = torch.zeros(1, 1000, device=device)
    params = SamplingParams(temperature=1.0)

    def draw(sampler: Sampler) -> list[int]:
        gen = sampler.generator_for(params)
        assert gen is not None
        return [sampler.sample(logits, [params], [gen])[0].token for _ in range(16)]

    first, second = Sampler(device), Sampler(device)
    assert draw(first) != draw(second)
    assert draw(first) != draw(first)
    shared = [Sampler(device).sample(logits, [params], [None])[0].token for _ in range(16)]
    assert len(set(shared)) > 1  # a fresh sampler's shared generator is not seeded alike each time


@pytest.fixture(scope="module")
def poisoned(make_checkpoint, tmp_path_factory):
    """The tiny checkpoint with one token's embedding row NaN: prompts holding it yield NaN logits."""
    from freetoken.loader.tokenizer import Tokenizer

    src = make_checkpoint("qwen3_moe")
    d = tmp_path_factory.mktemp("poisoned") / "ckpt"
    shutil.copytree(src, d)
    (token,) = Tokenizer.from_dir(d).encode(POISON_TEXT)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.embed_tokens.weight"][token] = float("nan")
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d, token


def engine_config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=128)


async def collect(llm, prompt: list[int], params: SamplingParams, rid: str):
    chunks = [c async for c in llm.generate(prompt, params, rid)]
    return [t for c in chunks for t in c.token_ids], chunks[-1]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_engine_fails_the_poisoned_request_and_serves_the_others(poisoned, params):
    model_dir, token = poisoned
    params = SamplingParams(**{**{f: getattr(params, f) for f in params.__struct_fields__},
                               "max_tokens": 6, "ignore_eos": True})
    healthy = [1, 2, 3, 4]

    async def main():
        async with AsyncLLM.start(engine_config(model_dir)) as llm:
            results = {}

            async def one(name, prompt):
                results[name] = await collect(llm, prompt, params, name)

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "poisoned", [1, 2, token, 3])
                tg.start_soon(one, "healthy", healthy)
            results["after"] = await collect(llm, healthy, params, "after")
            return results, llm.health()

    results, health = anyio.run(main)
    tokens, last = results["poisoned"]
    assert tokens == [] and last.finish_reason == "error" and NON_FINITE_LOGITS in last.error
    assert results["healthy"][1].finish_reason == "length" and len(results["healthy"][0]) == 6
    assert results["after"][0] == results["healthy"][0]  # the same seed (or greedy): the same tokens
    assert health["status"] == "ok"


def test_all_nan_weights_are_an_http_error_not_an_empty_answer(make_checkpoint, tmp_path):
    """The reported case: an all-NaN output head made greedy decoding answer EOS with HTTP 200."""
    d = tmp_path / "nan"
    shutil.copytree(make_checkpoint("qwen3_moe"), d)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["lm_head.weight"].fill_(float("nan"))
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with running_server(lambda: AsyncLLM.start(engine_config(d))) as srv:
        client = srv.client()
        for temperature in (0.0, 1.0):
            with pytest.raises(openai.InternalServerError) as info:
                client.chat.completions.create(
                    model="nan", messages=[{"role": "user", "content": "hello"}], max_tokens=4,
                    temperature=temperature,
                )
            assert NON_FINITE_LOGITS in json.dumps(info.value.body)


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1])
def test_a_seed_the_generator_cannot_take_is_a_request_error(seed):
    """The HTTP front end's int64 rule, for every caller: a seed torch cannot take failed inside the step."""
    with pytest.raises(RequestError, match="seed: must fit in a signed 64-bit integer"):
        SamplingParams(temperature=1.0, seed=seed).validate()
    SamplingParams(temperature=1.0, seed=seed // 2).validate()
