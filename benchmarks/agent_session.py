"""An agent session, turn by turn, with and without prefix reuse.

    python -m benchmarks.agent_session --model DIR --out FILE [--device cuda] [--turns 8] \\
        [--system-tokens 8192] [--tool-result-tokens 1024,4096] [--edit-turn 3] \\
        [--moe-policy hybrid --moe-cache-rate 0.375 --bw-profile PROFILE]

The conversation an agent loop builds: a system prompt with tool definitions (about
`--system-tokens` tokens), then turns that each append one assistant tool call and its tool
result (between the two `--tool-result-tokens` bounds), each turn sent as a whole new request as
the OpenAI and Anthropic APIs do. The assistant's turns are fixed tool calls, not the model's
output, so the session is the same whatever the (synthetic) weights say. After the last turn one
request edits the tool result of `--edit-turn` and sends the conversation again: an engine that
reuses its cache must re-prefill from the edit on, not from the start.

Each request runs twice, in two engines: prefix reuse on and off. Per turn: prompt tokens,
tokens actually prefilled (prompt minus the reused ones the engine reports), time to first token
and decode tok/s (greedy, `--decode-tokens` tokens, end of sequence ignored). Writes JSON with
the machine, command and commit; the targets (issue 31) are in its "summary": the appended turns'
TTFT with reuse against without, the edit's prefilled tokens against the tokens after the edit,
and the last turn's decode rate against the first's.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import anyio

from freetoken.config import EngineConfig, MoeConfig, SamplingParams, SchedulerConfig
from freetoken.engine.llm import AsyncLLM

WORDS = ("read", "file", "path", "line", "value", "error", "build", "test", "module", "return", "config", "token",
         "cache", "layer", "result", "parse", "query", "index", "stream", "session", "commit", "branch", "search")


def text_of(rng: random.Random, tokens: int, tokenizer) -> str:
    """Words until the text is about `tokens` tokens long."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < tokens:
        words.extend(rng.choice(WORDS) for _ in range(max(8, (tokens - len(words)) // 2)))
    return " ".join(words)


def tools(rng: random.Random, tokens: int, tokenizer) -> list[dict]:
    """Tool definitions whose descriptions bring the rendered system prompt to about `tokens`."""
    out, each = [], 400
    for i in range(max(1, tokens // each)):
        out.append({"type": "function", "function": {
            "name": f"tool_{i}", "description": text_of(rng, each - 60, tokenizer),
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                           "required": ["path"]}}})
    return out


def conversation(args: argparse.Namespace, tokenizer) -> tuple[list[dict], list[list[dict]]]:
    """(tools, the messages of each turn's request)."""
    rng = random.Random(args.seed)
    defs = tools(rng, args.system_tokens, tokenizer)
    low, high = (int(v) for v in args.tool_result_tokens.split(","))
    messages = [{"role": "system", "content": "You are a coding agent. Use the tools."},
                {"role": "user", "content": "Find why the build fails and fix it."}]
    turns = [list(messages)]
    for t in range(args.turns - 1):
        # arguments as an object: what the server hands the template after decoding the client's
        # JSON text (server/generation.py), and what the XML tool-call templates walk
        call = {"id": f"call_{t}", "type": "function",
                "function": {"name": f"tool_{t % len(defs)}", "arguments": {"path": f"src/{t}.py"}}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_{t}", "content": text_of(rng, rng.randint(low, high),
                                                                                       tokenizer)}]
        turns.append(list(messages))
    return defs, turns


def edited(turn: list[dict], edit_turn: int) -> tuple[list[dict], int]:
    """The last turn's messages with the tool result of `edit_turn` changed; the message index."""
    tool_messages = [i for i, m in enumerate(turn) if m["role"] == "tool"]
    index = tool_messages[min(edit_turn, len(tool_messages) - 1)]
    out = [dict(m) for m in turn]
    out[index]["content"] = "EDITED " + out[index]["content"]
    return out, index


def warm_up_prompts(session_first_token: int, prefill_chunk: int, room: int) -> list[list[int]]:
    """Requests sharing no prefix with the session, run by both engines before it, so that no
    turn's time includes kernel compilation: a prompt whose length is a multiple of 16 and one
    whose is not (Triton compiles an integer argument's variants by its divisibility by 16), the
    second again with tokens appended (the reuse engine resumes it from its anchor: the resumed
    prefill's kernels), and one longer than a prefill chunk (a chunk that starts mid-prompt) where
    `room` tokens hold it."""
    def tokens(n: int, offset: int) -> list[int]:
        return [(session_first_token + offset + i) % 1000 for i in range(n)]

    odd = tokens(263, 1)
    long = [tokens(prefill_chunk + 77, 3)] if prefill_chunk + 77 <= room else []
    return [tokens(256, 2), odd, odd + tokens(141, 500), *long]


async def run_engine(args: argparse.Namespace, reuse: bool, prompts: list[list[int]]) -> list[dict]:
    config = EngineConfig(model=args.model, device=args.device, max_model_len=args.max_model_len,
                          scheduler=SchedulerConfig(prefix_reuse=reuse),
                          moe=MoeConfig(policy=args.moe_policy, cache_rate=args.moe_cache_rate,
                                        bw_profile=args.bw_profile))
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    rows = []
    async with AsyncLLM.start(config) as llm:
        room = args.max_model_len - args.decode_tokens  # (the longest warm-up is left out where it does not fit)
        for i, warm in enumerate(warm_up_prompts(prompts[0][0], config.scheduler.prefill_chunk, room)):
            async for chunk in llm.generate(warm, params, f"{'reuse' if reuse else 'cold'}-warm-up-{i}"):
                if chunk.error:
                    raise RuntimeError(f"warm-up: {chunk.error}")
        for i, ids in enumerate(prompts):
            before = await llm.cache_status()
            started = time.perf_counter()
            first = None
            cached = tokens = 0
            async for chunk in llm.generate(ids, params, f"{'reuse' if reuse else 'cold'}-{i}"):
                if chunk.error:
                    raise RuntimeError(f"request {i}: {chunk.error}")
                if chunk.token_ids and first is None:
                    first = time.perf_counter()
                cached = max(cached, chunk.cached_tokens)
                tokens = chunk.completion_tokens
            done = time.perf_counter()
            rows.append({"prompt_tokens": len(ids), "cached_tokens": cached, "prefilled_tokens": len(ids) - cached,
                         "ttft_s": (first or done) - started,
                         "decode_tok_per_s": (tokens - 1) / (done - first) if first and tokens > 1 and done > first
                         else None, **expert_traffic(before, await llm.cache_status())})
    return rows


def expert_traffic(before: dict, after: dict) -> dict:
    """What one turn moved: prefill streaming's bytes over PCIe and experts copied on the GPU, the
    decode plans' fetched bytes, and the plans' hit rate (where the turn's time goes)."""
    copied = after["prefill_experts_streamed"]["on_device"] - before["prefill_experts_streamed"]["on_device"]
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    return {"prefill_pcie_bytes": after["prefill_bytes_streamed"] - before["prefill_bytes_streamed"],
            "prefill_experts_copied_on_gpu": copied,
            "plan_pcie_bytes": after["bytes_fetched"] - before["bytes_fetched"],
            "plan_hit_rate": hits / (hits + misses) if hits + misses else None}


def summary(reuse: list[dict], cold: list[dict], edit_from: int) -> dict:
    appended = range(1, len(reuse) - 1)  # the turns after the first, before the edit
    ttft = [reuse[i]["ttft_s"] / cold[i]["ttft_s"] for i in appended if cold[i]["ttft_s"] > 0]
    edit = reuse[-1]
    first, last = reuse[0]["decode_tok_per_s"], reuse[-2]["decode_tok_per_s"]
    return {
        "appended_ttft_reuse_over_cold_max": max(ttft) if ttft else None,
        "appended_ttft_target": "<= 0.15",
        "edit_prefilled_tokens": edit["prefilled_tokens"],
        "edit_tokens_from_the_edit": edit["prompt_tokens"] - edit_from,
        "last_over_first_decode": last / first if first and last else None,
        "decode_target": ">= 0.9",
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=8192)
    p.add_argument("--tool-result-tokens", default="1024,4096", help="LOW,HIGH tokens per tool result")
    p.add_argument("--edit-turn", type=int, default=3, help="which tool result the edit changes (0-based)")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=65536)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--moe-policy", default=MoeConfig().policy)
    p.add_argument("--moe-cache-rate", type=float, default=None, help="expert slots as a share of the pool")
    p.add_argument("--bw-profile", default=None, help="`bench bw`'s profile: hybrid's split from this machine's links")
    args = p.parse_args()

    from freetoken.engine.llm import open_checkpoint, resolve_model_dir

    config = EngineConfig(model=args.model, device=args.device)
    tokenizer = open_checkpoint(resolve_model_dir(config), config)
    defs, turns = conversation(args, tokenizer)
    edit, index = edited(turns[-1], args.edit_turn)
    rendered = [tokenizer.apply_chat_template(m, tools=defs) for m in [*turns, edit]]
    prompts = [tokenizer.encode(text) for text in rendered]
    # where the edited prompt first differs from the last turn's: what a reusing engine must prefill
    same = next((i for i, (a, b) in enumerate(zip(prompts[-2], prompts[-1], strict=False)) if a != b), len(prompts[-1]))
    if max(map(len, prompts)) + args.decode_tokens > args.max_model_len:
        raise SystemExit(f"the session reaches {max(map(len, prompts))} tokens: raise --max-model-len")
    reuse = anyio.run(run_engine, args, True, prompts)
    cold = anyio.run(run_engine, args, False, prompts)
    report = {
        "command": " ".join(["python -m benchmarks.agent_session", *sys.argv[1:]]),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "edited_message": index, "edit_first_differing_token": same,
        "turns": [{"turn": i, "reuse": r, "no_reuse": c} for i, (r, c) in enumerate(zip(reuse, cold, strict=True))],
        "summary": summary(reuse, cold, same),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for row in report["turns"]:
        r, c = row["reuse"], row["no_reuse"]
        print(f"turn {row['turn']}: {r['prompt_tokens']} tokens; prefilled {r['prefilled_tokens']} (reuse) / "
              f"{c['prefilled_tokens']}; TTFT {r['ttft_s'] * 1e3:.0f} / {c['ttft_s'] * 1e3:.0f} ms")
    print(json.dumps(report["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
