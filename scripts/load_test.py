"""Load, faults and bad input against a real `vllm serve` on loopback.

For plain vLLM and then each method, one server (float32, eager, a KV cache of
`--kv-blocks` blocks so that the clients force preemption) gets one fixed,
seeded list of requests from `--clients` concurrent clients, for at most
`--duration` seconds or `--max-requests` requests. The list mixes greedy and
sampled, streamed and whole completions and chats, stop strings, n > 1,
logprobs, prompts near max_model_len, regex- and JSON-constrained outputs,
clients that disconnect mid-stream or give up (aborts), and bad requests.
Checked per server:
- no server error: no 5xx, no broken stream the client did not cut, bad
  requests answered 4xx, /health fine after the run;
- every greedy answer equal to the first server's (plain vLLM) for the same
  request, constrained answers valid;
- the drafter's per-request state bounded after the run, worker memory.
Figures (requests, duration, errors, parity, p50/p99 latency, tokens/s,
preemptions) go to runs/<name>.json and a table on stdout.

    python scripts/load_test.py                      # plain, then every method
    python scripts/load_test.py --methods plain,del --duration 60
    python scripts/load_test.py --url http://HOST:8000 --model MODEL   # a running server

With `--url` it is the client for a server started elsewhere (e.g. by
scripts/serve_tp.sh): throughput, latency and acceptance, no parity reference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import requests
from bench.presets import settings_for
from bench.provenance import provenance
from serving import Server, vllm_serve
from tqdm import tqdm

from vllm_selfspec import prompts as prompt_sets
from vllm_selfspec.assets import RESULTS_DIR as RESULTS
from vllm_selfspec.assets import ROOT

MODEL_DIR = ROOT / "models" / "smollm2-135m"
# The servers after plain vLLM's: the recommended setting, then each method at
# its defaults.
METHODS = ("recommended", "draft_verify", "adadecode", "del", "swift")
MAX_MODEL_LEN = 1024
PHONE = r"[0-9]{3}-[0-9]{4}"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
# Kinds of request, with how often each comes.
KINDS = {"completion": 6, "completion_stream": 6, "chat": 4, "chat_stream": 4,
         "stop": 3, "logprobs": 2, "sampling_n2": 3, "long_prompt": 1, "regex": 2,
         "json": 2, "disconnect": 2, "abort": 2, "bad_params": 1, "too_long": 1,
         "malformed": 1, "task_key": 3}
GREEDY_KINDS = {"completion", "completion_stream", "chat", "chat_stream", "stop",
                "logprobs", "long_prompt", "regex", "json", "task_key"}
# SWIFT task keys a client may send: path traversal, an absolute path, and a
# new key per request (unbounded state if the server kept one search per key).
HOSTILE_TASK_KEYS = ("../../../tmp/selfspec-escape", "/tmp/selfspec-escape", "a/b")
REJECTED_KINDS = {"bad_params", "too_long", "malformed"}


@dataclass
class Outcome:
    index: int
    kind: str
    status: str  # ok | rejected (4xx as expected) | cut (by the client) | error
    seconds: float
    text: str | None = None  # greedy answers, for parity
    detail: str = ""


def build_requests(count: int, model: str, tokenizer, seed: int = 0) -> list[dict]:
    """The seeded request list every server gets in the same order."""
    rng = random.Random(seed)
    questions = prompt_sets.mixed(48)
    long_text = "\n".join(prompt_sets.humaneval(40))
    long_ids = tokenizer(long_text)["input_ids"]
    kinds = [kind for kind, weight in KINDS.items() for _ in range(weight)]
    plan = []
    for index in range(count):
        kind = rng.choice(kinds)
        # Prompt tails: short enough that 32 clients are not all prefill on a CPU.
        prompt = questions[index % len(questions)][-300:]
        body: dict = {"model": model, "temperature": 0.0,
                      "max_tokens": rng.choice([8, 24, 48, 96])}
        if kind in ("chat", "chat_stream", "json"):
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if kind in ("completion_stream", "chat_stream", "disconnect"):
            body["stream"] = True
        if kind == "stop":
            body["stop"] = ["\n\n", "."]
        elif kind == "logprobs":
            body["logprobs"] = 2
        elif kind == "sampling_n2":
            body.update(temperature=0.8, top_p=0.95, n=2, seed=index)
        elif kind == "long_prompt":
            body["prompt"] = tokenizer.decode(long_ids[:MAX_MODEL_LEN - 120])
            body["max_tokens"] = 64
        elif kind == "regex":
            body["prompt"] = "My phone number is "
            body["structured_outputs"] = {"regex": PHONE}
        elif kind == "json":
            body["messages"] = [{"role": "user", "content": "Describe a person as JSON."}]
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON}}
            body["max_tokens"] = 64
        elif kind == "abort":
            body["max_tokens"] = 200
        elif kind == "bad_params":
            body["temperature"] = -1.0
        elif kind == "too_long":
            body["prompt"] = tokenizer.decode(long_ids[:MAX_MODEL_LEN + 200])
        elif kind == "task_key":  # answered as the default task, greedy as any other
            key = rng.choice([*HOSTILE_TASK_KEYS, f"client-{index}"])
            body["vllm_xargs"] = {"selfspec_task": key}
        plan.append({"kind": kind, "body": body,
                     "path": "/v1/chat/completions" if "messages" in body
                     else "/v1/completions"})
    return plan


async def send(session: aiohttp.ClientSession, url: str, index: int, request: dict) -> Outcome:
    kind, body = request["kind"], request["body"]
    started = time.perf_counter()

    def outcome(status: str, **extra) -> Outcome:
        return Outcome(index, kind, status, time.perf_counter() - started, **extra)

    try:
        if kind == "malformed":
            async with session.post(url + request["path"], data="{not json",
                                    headers={"Content-Type": "application/json"}) as response:
                return _expect_4xx(outcome, response.status, await response.text())
        if kind == "abort":
            try:
                async with session.post(url + request["path"], json=body,
                                        timeout=aiohttp.ClientTimeout(total=0.3)) as response:
                    await response.read()
                    return outcome("ok" if response.status == 200 else "error",
                                   detail=str(response.status))
            except asyncio.TimeoutError:
                return outcome("cut")
        async with session.post(url + request["path"], json=body) as response:
            if kind in REJECTED_KINDS:
                return _expect_4xx(outcome, response.status, await response.text())
            if response.status != 200:
                return outcome("error", detail=f"{response.status} {(await response.text())[:200]}")
            if body.get("stream"):
                return await _read_stream(response, kind, outcome)
            answer = await response.json()
            return _check(outcome, kind, _texts(answer), answer["choices"][0].get("finish_reason"))
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        return outcome("error", detail=repr(error))


def _expect_4xx(outcome, status: int, text: str) -> Outcome:
    if 400 <= status < 500:
        return outcome("rejected")
    return outcome("error", detail=f"expected 4xx, got {status} {text[:200]}")


async def _read_stream(response, kind: str, outcome) -> Outcome:
    pieces, chunks, done = [], 0, False
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        chunks += 1
        for choice in json.loads(line[6:])["choices"]:
            pieces.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
        if kind == "disconnect" and chunks == 2:
            response.close()  # the client goes away mid-stream
            return outcome("cut")
    if not done:
        return outcome("error", detail=f"stream ended after {chunks} chunks without [DONE]")
    return _check(outcome, kind, ["".join(pieces)])


def _texts(answer: dict) -> list[str]:
    return [choice.get("text", choice.get("message", {}).get("content")) or ""
            for choice in answer["choices"]]


def _check(outcome, kind: str, texts: list[str], finish_reason: str | None = None) -> Outcome:
    """Constrained outputs must be complete and valid unless cut by max_tokens."""
    text = texts[0]
    if kind == "regex" and not re.fullmatch(PHONE, text):
        return outcome("error", detail=f"regex output {text!r}")
    if kind == "json" and finish_reason != "length":
        try:
            person = json.loads(text)
            assert isinstance(person["name"], str) and isinstance(person["age"], int)
        except (ValueError, KeyError, AssertionError, TypeError):
            return outcome("error", detail=f"JSON output {text!r}")
    if kind == "sampling_n2" and len(texts) != 2:
        return outcome("error", detail=f"n=2 gave {len(texts)} choices")
    return outcome("ok", text=text if kind in GREEDY_KINDS else None)


async def run_clients(url: str, plan: list[dict], clients: int, duration: float) -> list[Outcome]:
    """`clients` concurrent clients take the next request until the list or
    the time is used up."""
    next_index = 0
    deadline = time.perf_counter() + duration
    outcomes: list[Outcome] = []
    progress = tqdm(total=len(plan), desc="requests", leave=False)

    async def client(session) -> None:
        nonlocal next_index
        while next_index < len(plan) and time.perf_counter() < deadline:
            index, next_index = next_index, next_index + 1
            outcomes.append(await send(session, url, index, plan[index]))
            progress.update()

    timeout = aiohttp.ClientTimeout(total=600)
    # Idle connections are dropped well before vLLM's server closes them
    # (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): aiohttp's default (15 s) lets a
    # client reuse a connection the server is closing, a client-side error.
    connector = aiohttp.TCPConnector(keepalive_timeout=1.0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    progress.close()
    return sorted(outcomes, key=lambda o: o.index)


@dataclass
class Report:
    name: str
    requests: int
    seconds: float
    by_status: dict
    by_kind: dict = field(default_factory=dict)  # requests sent, per kind
    errors: list = field(default_factory=list)
    greedy_compared: int = 0
    greedy_identical: int = 0
    mismatched: list = field(default_factory=list)
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0
    tokens_per_s: float = 0.0  # every token the server generated, streamed and cut ones too
    acceptance: float | None = None  # accepted / drafted tokens, from /metrics
    mean_accepted_length: float | None = None  # tokens per verification incl. the bonus
    preemptions: float = 0.0
    healthy_after: bool = False
    state_after_run: list = field(default_factory=list)
    state_after_one_more: list = field(default_factory=list)


def load_run(server: Server, name: str, plan: list[dict], args,
             reference: dict[int, str] | None) -> tuple[Report, dict[int, str]]:
    before = server.spec_counters()
    generated = server.metric("vllm:generation_tokens_total")
    started = time.perf_counter()
    outcomes = asyncio.run(run_clients(server.url, plan, args.clients, args.duration))
    seconds = time.perf_counter() - started
    generated = server.metric("vllm:generation_tokens_total") - generated
    drafted, accepted, drafts = (b - a for a, b in zip(before, server.spec_counters()))
    finished = [o for o in outcomes if o.status == "ok"]
    latencies = sorted(o.seconds for o in finished) or [0.0]
    greedy = {o.index: o.text for o in finished if o.text is not None}
    report = Report(
        name=name, requests=len(outcomes), seconds=seconds,
        by_status=dict(sorted(Counter(o.status for o in outcomes).items())),
        by_kind=dict(sorted(Counter(o.kind for o in outcomes).items())),
        errors=[asdict(o) for o in outcomes if o.status == "error"][:20],
        latency_p50_s=latencies[len(latencies) // 2],
        latency_p99_s=latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        tokens_per_s=generated / seconds,
        preemptions=server.metric("vllm:num_preemptions_total"),
    )
    if drafted:
        report.acceptance = accepted / drafted
        report.mean_accepted_length = 1 + accepted / drafts
    if reference is not None:
        common = sorted(set(greedy) & set(reference))
        report.greedy_compared = len(common)
        report.mismatched = [i for i in common if greedy[i] != reference[i]]
        report.greedy_identical = len(common) - len(report.mismatched)
    report.healthy_after = requests.get(f"{server.url}/health", timeout=30).status_code == 200
    if server.process is not None:  # started here, in dev mode: the leak check
        report.state_after_run = server.collective_rpc("selfspec_state")
        requests.post(f"{server.url}/v1/completions", json={
            "model": plan[0]["body"]["model"], "prompt": "Hello", "max_tokens": 16},
            timeout=120).raise_for_status()
        report.state_after_one_more = server.collective_rpc("selfspec_state")
    return report, greedy


def server_args(args) -> list[str]:
    return ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
            "--block-size", "32", "--max-num-seqs", str(args.max_num_seqs),
            "--num-gpu-blocks-override", str(args.kv_blocks), "--seed", "0"]


def print_table(reports: list[Report]) -> None:
    print(f"{'server':>14} {'requests':>8} {'s':>6} {'errors':>6} {'greedy same':>11} "
          f"{'p50 s':>6} {'p99 s':>6} {'tok/s':>6} {'accept':>6} {'preempt':>7} "
          f"{'state after':>11} {'tasks':>5}")
    for r in reports:
        state = max((max((n for kind, n in rank["requests_with_state"].items()
                          if kind != "tasks"), default=0)
                     for rank in r.state_after_run), default=0)
        tasks = max((rank["requests_with_state"].get("tasks", 0)
                     for rank in r.state_after_run), default=0)
        print(f"{r.name:>14} {r.requests:>8} {r.seconds:>6.0f} "
              f"{r.by_status.get('error', 0):>6} "
              f"{r.greedy_identical:>5}/{r.greedy_compared:<5} {r.latency_p50_s:>6.2f} "
              f"{r.latency_p99_s:>6.2f} {r.tokens_per_s:>6.1f} "
              f"{'-' if r.acceptance is None else f'{r.acceptance:.2f}':>6} "
              f"{r.preemptions:>7.0f} {state:>11} {tasks:>5}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="plain," + ",".join(METHODS),
                        help="servers in order; the first is the greedy reference")
    parser.add_argument("--model", default=str(MODEL_DIR))
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=240, help="seconds per server")
    parser.add_argument("--max-requests", type=int, default=1200)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--kv-blocks", type=int, default=64,
                        help="KV blocks of 32 tokens: small, to force preemption")
    parser.add_argument("--name", default="load-test")
    parser.add_argument("--url", help="load a running server instead of starting servers")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    plan = build_requests(args.max_requests, args.model,
                          AutoTokenizer.from_pretrained(args.model))
    reports, reference = [], None
    if args.url:
        reports.append(load_run(Server(args.url, None, None), args.name, plan, args, None)[0])
        print_table(reports)
    settings = settings_for(Path(args.model).name)
    for position, name in enumerate([] if args.url else args.methods.split(",")):
        spec = settings[name]
        log = RESULTS / "logs" / f"{args.name}-{position}-{name}.log"
        with vllm_serve(args.model, spec, log, server_args(args), dev_mode=True,
                        env={"VLLM_CPU_KVCACHE_SPACE": "1"}) as server:
            report, greedy = load_run(server, name, plan, args, reference)
        reference = greedy if reference is None else reference
        reports.append(report)
        print_table(reports)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{args.name}.json"
    command = "python scripts/load_test.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)
    out.write_text(json.dumps({**provenance(), "dtype_md": "float32, eager",  # server_args
                               "command": command, "reports": [asdict(r) for r in reports]},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
