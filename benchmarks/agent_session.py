"""An agentic session: a system prompt with tool definitions, then turns that each append the
model's reply and a tool result. Per turn: time to first token and decode tok/s, with and
without KV reuse of the previous turn (the engine's prefix reuse).

    python -m benchmarks.agent_session --model DIR [--turns 8] [--tool-result-tokens 400] \\
        [--max-tokens 32] [--device cuda] [--moe-policy hybrid --moe-cache-rate 0.37] --out FILE

Writes JSON with the machine, command and commit; prints one line per turn.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time

import anyio

from freetoken.config import EngineConfig, MoeConfig, SamplingParams, SchedulerConfig
from freetoken.engine.llm import AsyncLLM

TOOLS = [
    {"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "query": {"type": "string"}},
                       "required": ["path"]}}}
    for name, desc in [("read_file", "Read a file of the repository."), ("grep", "Search the repository."),
                       ("run_tests", "Run the test suite and report failures."), ("edit", "Replace text in a file.")]
]
SYSTEM = "You are a coding agent. Use the tools to inspect and fix the repository. " * 8


def tool_result(turn: int, tokens: int) -> str:
    """A deterministic JSON-ish tool output of roughly `tokens` tokens."""
    lines = [f'{{"line": {i}, "file": "src/module_{turn}.py", "text": "value_{turn}_{i} = compute({i})"}}'
             for i in range(max(1, tokens // 24))]
    return "\n".join(lines)


async def session(config: EngineConfig, turns: int, result_tokens: int, max_tokens: int) -> list[dict]:
    out = []
    async with AsyncLLM.start(config) as llm:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the failing test."}]
        for turn in range(turns):
            prompt = llm.tokenizer.encode(
                llm.tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True))
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            started = time.perf_counter()
            first = None
            text, cached, count = [], 0, 0
            async for chunk in llm.generate(prompt, params, f"turn{turn}"):
                first = first or time.perf_counter()
                text.append(chunk.text)
                cached = max(cached, chunk.cached_tokens)
                count = chunk.completion_tokens
            end = time.perf_counter()
            out.append({"turn": turn, "prompt_tokens": len(prompt), "cached_tokens": cached,
                        "ttft_s": first - started,
                        "decode_tok_per_s": (count - 1) / (end - first) if count > 1 and end > first else 0.0})
            call = {"id": f"call_{turn}", "type": "function",
                    "function": {"name": TOOLS[turn % len(TOOLS)]["function"]["name"],
                                 "arguments": json.dumps({"path": f"src/module_{turn}.py"})}}
            messages.append({"role": "assistant", "content": "".join(text), "tool_calls": [call]})
            result = tool_result(turn, result_tokens)
            messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": result})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="demo")
    p.add_argument("--device", default="auto")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--tool-result-tokens", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--moe-policy", default="auto")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--moe-cache-rate", type=float, default=None)
    size.add_argument("--moe-cache-slots", type=int, default=None)
    p.add_argument("--bw-profile", default=None, help="bandwidth profile for the hybrid split (bench bw)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    runs = {}
    for reuse in (True, False):
        config = EngineConfig(model=args.model, device=args.device, max_model_len=args.max_model_len,
                              moe=MoeConfig(policy=args.moe_policy, cache_rate=args.moe_cache_rate,
                                            cache_slots=args.moe_cache_slots, bw_profile=args.bw_profile),
                              scheduler=SchedulerConfig(prefix_reuse=reuse), max_running_requests=1)
        runs["with_reuse" if reuse else "without_reuse"] = anyio.run(
            session, config, args.turns, args.tool_result_tokens, args.max_tokens)
    for a, b in zip(runs["with_reuse"], runs["without_reuse"], strict=True):
        a["ttft_over_no_reuse"] = a["ttft_s"] / b["ttft_s"]
        print(f"turn {a['turn']}: prompt {a['prompt_tokens']:6d}  cached {a['cached_tokens']:6d}  "
              f"TTFT {a['ttft_s'] * 1e3:8.1f} ms vs {b['ttft_s'] * 1e3:8.1f} ms without reuse "
              f"({a['ttft_over_no_reuse']:.0%})  decode {a['decode_tok_per_s']:.1f} tok/s", flush=True)
    import torch

    report = {
        "command": "python -m benchmarks.agent_session " + " ".join(sys.argv[1:]),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "machine": {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                    "cpu": platform.processor() or platform.machine()},
        "runs": runs,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
