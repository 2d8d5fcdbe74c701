"""`python -m freetoken generate`: one prompt through the same engine the server uses.

Generated text goes to stdout as it is produced; diagnostics go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from freetoken.config import EngineConfig, SamplingParams


def add_generate_arguments(gen: argparse.ArgumentParser) -> None:
    """The prompt and its sampling; greedy unless asked (SamplingParams' own defaults are an API's)."""
    gen.add_argument("--prompt", required=True, help="the prompt, tokenized as raw text unless --chat")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true",
                     help='print one JSON object {"prompt_token_ids", "token_ids", "text"} instead of streaming')


def run_generate(config: EngineConfig, args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    ).validate()
    import anyio  # here, not at the top: building the parser imports this module

    return anyio.run(_generate, config, args.prompt, args.chat, params, args.json)


async def _generate(config: EngineConfig, prompt: str, chat: bool, params: SamplingParams, as_json: bool) -> int:
    from freetoken.engine.llm import AsyncLLM

    async with AsyncLLM.start(config) as llm:
        tok = llm.tokenizer
        text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
        prompt_ids = tok.encode(text)
        print(f"[freetoken] model {llm.model_name}, prompt {len(prompt_ids)} tokens", file=sys.stderr)
        started = time.perf_counter()
        first_at = None
        token_ids: list[int] = []
        pieces: list[str] = []
        finish = None
        async for chunk in llm.generate(prompt_ids, params, "generate-0"):
            first_at = first_at or time.perf_counter()
            token_ids += chunk.token_ids
            pieces.append(chunk.text)
            finish = chunk.finish_reason
            if not as_json:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            if chunk.error:
                print(f"\n[freetoken] error: {chunk.error}", file=sys.stderr)
                return 1
        elapsed = time.perf_counter() - started
        if as_json:
            print(json.dumps({"prompt_token_ids": prompt_ids, "token_ids": token_ids, "text": "".join(pieces)}))
        else:
            print()
        decode_s = elapsed - ((first_at or started) - started)
        rate = (len(token_ids) - 1) / decode_s if len(token_ids) > 1 and decode_s > 0 else 0.0
        print(
            f"[freetoken] {len(token_ids)} tokens, finish={finish}, "
            f"first token {((first_at or started) - started) * 1e3:.0f} ms, decode {rate:.1f} tok/s",
            file=sys.stderr,
        )
    return 0
