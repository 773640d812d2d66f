"""Train exit heads (AdaDecode's lightweight LM heads) for a model, on the CPU.

Three resumable stages, each cached under .cache/heads/<model>/:
  1. on-policy data: vLLM decodes the model's own greedy answers to HumanEval,
     MT-bench and GSM-style prompts (or a JSONL of {"prompt": ...}), skipping
     the prompts the benchmark uses;
  2. hidden states: one teacher-forced transformers forward per sequence keeps
     the residual stream after each exit layer and the final normed state at
     every position that predicts an answer token;
  3. training: per exit layer E a d x d transform T_E (starting at the
     identity, i.e. the model's own early exit) so that
     softmax(E* . T_E . norm(h_E)) matches the final distribution (KL), model
     frozen; AdamW with warm-up and cosine decay as in the paper.
Writes <out>/heads.json, heads.safetensors and agreement.png (held-out top-1
agreement per layer before and after training), by default under runs/heads/
(give the directory as `heads`); `--install` also puts them among the shipped
heads, where a method finds them by the model's weights.

    python scripts/train_exit_heads.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from bench.runner import shutdown
from vllm_selfspec import prompts as prompt_sets
from vllm_selfspec.assets import CONFIGS_DIR, RESULTS_DIR, ROOT, fast_dtype
from vllm_selfspec.draft.heads import model_identity, save_heads

BENCHMARK_PROMPTS = 8  # per set; scripts/benchmark.py uses the first ones


def model_path(name: str) -> Path:
    path = Path(name)
    return path if path.exists() else ROOT / "models" / name


def load_questions(args) -> list[str]:
    if args.prompts_jsonl:
        lines = Path(args.prompts_jsonl).read_text().splitlines()
        return [json.loads(line)["prompt"] for line in lines if line.strip()]
    n, skip = args.num_prompts, BENCHMARK_PROMPTS
    return (prompt_sets.humaneval(skip + n)[skip:] + prompt_sets.mtbench(skip + n)[skip:]
            + prompt_sets.gsm_style(n, seed=1))


def generate_data(args, model_dir: Path, data_file: Path) -> list[list[int]]:
    """Token ids of prompt + greedy answer, and where each answer starts."""
    if data_file.exists():
        return json.loads(data_file.read_text())
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = prompt_sets.as_chat(tokenizer, load_questions(args))
    llm = LLM(model=str(model_dir), dtype=args.dtype, max_model_len=2048, seed=0,
              enforce_eager=True)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0,
                                                   max_tokens=args.max_tokens))
    records = [[list(o.prompt_token_ids), list(o.outputs[0].token_ids)] for o in outputs]
    shutdown(llm)
    data_file.write_text(json.dumps(records))
    return records


@torch.no_grad()
def extract_states(model, records, exit_layers: list[int], states_file: Path) -> dict:
    """Per answer-predicting position: h after each exit layer, final normed h."""
    if states_file.exists():
        return torch.load(states_file)
    exits = {layer: [] for layer in exit_layers}
    finals, sequence_of = [], []
    for index, (prompt_ids, answer_ids) in enumerate(tqdm(records, desc="hidden states")):
        if not answer_ids:
            continue
        ids = torch.tensor([prompt_ids + answer_ids])
        hidden = model(ids, output_hidden_states=True).hidden_states
        first, last = len(prompt_ids) - 1, len(prompt_ids) + len(answer_ids) - 1
        for layer in exit_layers:
            exits[layer].append(hidden[layer][0, first:last])
        finals.append(hidden[-1][0, first:last])
        sequence_of.append(torch.full((last - first,), index))
    states = {"exits": {k: torch.cat(v) for k, v in exits.items()},
              "final": torch.cat(finals), "sequence": torch.cat(sequence_of)}
    torch.save(states, states_file)
    return states


def head_logits(model, transform: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
    normed = model.model.norm(hidden)
    if transform is not None:
        normed = normed @ transform.t()
    return model.lm_head(normed)


@torch.no_grad()
def evaluate(model, transforms, states, rows, batch: int) -> dict[int, dict[str, float]]:
    """Held-out top-1 agreement with the full model and KL(final || head)."""
    result = {}
    for layer, transform in transforms.items():
        agree, kl, count = 0.0, 0.0, 0
        for start in range(0, len(rows), batch):
            index = rows[start:start + batch]
            target = model.lm_head(states["final"][index]).log_softmax(-1)
            logp = head_logits(model, transform, states["exits"][layer][index]).log_softmax(-1)
            agree += (logp.argmax(-1) == target.argmax(-1)).sum().item()
            kl += F.kl_div(logp, target, log_target=True, reduction="sum").item()
            count += len(index)
        result[layer] = {"agreement": agree / count, "kl": kl / count}
    return result


def train(model, states, train_rows, args, checkpoint: Path) -> dict[int, torch.Tensor]:
    d = model.config.hidden_size
    transforms = {layer: torch.eye(d).requires_grad_() for layer in args.exit_layers}
    optimizer = torch.optim.AdamW(transforms.values(), lr=args.lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(train_rows) / args.batch_tokens)
    total = steps_per_epoch * args.epochs
    warmup = max(1, int(0.03 * total))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(
        (step + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(step / total, 1.0)))))
    first_epoch = 0
    if checkpoint.exists():
        saved = torch.load(checkpoint)
        for layer, value in saved["transforms"].items():
            transforms[layer].data.copy_(value)
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
        first_epoch = saved["epoch"] + 1
    generator = torch.Generator().manual_seed(0)
    for epoch in range(first_epoch, args.epochs):
        order = train_rows[torch.randperm(len(train_rows), generator=generator)]
        progress = tqdm(range(0, len(order), args.batch_tokens),
                        desc=f"epoch {epoch + 1}/{args.epochs}")
        for start in progress:
            index = order[start:start + args.batch_tokens]
            with torch.no_grad():
                target = model.lm_head(states["final"][index]).log_softmax(-1)
            loss = sum(
                F.kl_div(head_logits(model, transforms[layer],
                                     states["exits"][layer][index]).log_softmax(-1),
                         target, log_target=True, reduction="batchmean")
                for layer in args.exit_layers) / len(args.exit_layers)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            progress.set_postfix(kl=f"{loss.item():.3f}")
        torch.save({"epoch": epoch, "optimizer": optimizer.state_dict(),
                    "schedule": schedule.state_dict(),
                    "transforms": {k: v.detach() for k, v in transforms.items()}},
                   checkpoint)
    return {layer: value.detach() for layer, value in transforms.items()}


@torch.no_grad()
def own_head_agreement(model, records, held_out: list[int]) -> list[float]:
    """Held-out agreement of the model's own LM head at every layer (the plot's
    'before' curve over all layers)."""
    agree, count = None, 0
    for index in held_out:
        prompt_ids, answer_ids = records[index]
        if not answer_ids:
            continue
        hidden = model(torch.tensor([prompt_ids + answer_ids]),
                       output_hidden_states=True).hidden_states
        first, last = len(prompt_ids) - 1, len(prompt_ids) + len(answer_ids) - 1
        final = model.lm_head(hidden[-1][0, first:last]).argmax(-1)
        hits = torch.tensor([
            (head_logits(model, None, h[0, first:last]).argmax(-1) == final).sum().item()
            for h in hidden[1:-1]])
        agree = hits if agree is None else agree + hits
        count += last - first
    return (agree / count).tolist()


def plot(path: Path, name: str, own: list[float], evaluation: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 4))
    axis.plot(range(1, len(own) + 1), own, "o-", ms=3, color="grey",
              label="model's own LM head (untrained exit)")
    layers = sorted(evaluation["after"])
    axis.plot(layers, [evaluation["after"][k]["agreement"] for k in layers], "s",
              color="tab:red", ms=8, label="trained exit head")
    axis.set_xlabel("exit layer E (layers run)")
    axis.set_ylabel("held-out top-1 agreement with the full model")
    axis.set_ylim(0, 1.02)
    axis.set_title(f"{name}: exit heads before and after training")
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="name under models/ or a path")
    parser.add_argument("--exit-layers", help="comma-separated E values (default L/4, L/2, 3L/4)")
    parser.add_argument("--num-prompts", type=int, default=48, help="per prompt set")
    parser.add_argument("--prompts-jsonl", help="use these prompts instead")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--batch-tokens", type=int, default=256)
    parser.add_argument("--held-out", type=float, default=0.1, help="share of sequences")
    parser.add_argument("--dtype", default=fast_dtype(),
                        help="of the data-generating engine (bfloat16 where native, else float32)")
    parser.add_argument("--out", help="heads directory (default runs/heads/<model>)")
    parser.add_argument("--install", action="store_true",
                        help="also copy them into vllm_selfspec/configs/heads/<model>, "
                             "where methods find them by the model's weights")
    parser.add_argument("--workdir", help="cache for resuming (default .cache/heads/<model>)")
    args = parser.parse_args()
    started = time.perf_counter()
    torch.manual_seed(0)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    model_dir = model_path(args.model)
    name = model_dir.name
    from transformers import AutoConfig, AutoModelForCausalLM

    num_layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    args.exit_layers = ([int(x) for x in args.exit_layers.split(",")] if args.exit_layers
                        else [round(num_layers * f) for f in (0.25, 0.5, 0.75)])
    if not all(0 < e < num_layers for e in args.exit_layers):
        raise SystemExit(f"--exit-layers must lie in 1..{num_layers - 1}")
    workdir = Path(args.workdir or ROOT / ".cache" / "heads" / name)
    out = Path(args.out or RESULTS_DIR / "heads" / name)
    workdir.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)

    records = generate_data(args, model_dir, workdir / "data.json")
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    model.requires_grad_(False)
    exits_key = "-".join(map(str, args.exit_layers))  # cached states and checkpoint per exit set
    states = extract_states(model, records, args.exit_layers, workdir / f"states-{exits_key}.pt")
    num_held_out = max(1, round(args.held_out * len(records)))
    held_out_sequences = list(range(len(records) - num_held_out, len(records)))
    is_held_out = states["sequence"] >= held_out_sequences[0]
    train_rows = torch.nonzero(~is_held_out).view(-1)
    test_rows = torch.nonzero(is_held_out).view(-1)

    before = evaluate(model, {layer: None for layer in args.exit_layers}, states,
                      test_rows, args.batch_tokens)
    transforms = train(model, states, train_rows, args, workdir / f"checkpoint-{exits_key}.pt")
    after = evaluate(model, transforms, states, test_rows, args.batch_tokens)
    own = own_head_agreement(model, records, held_out_sequences)

    save_heads(
        out, name, model_identity(model.config, model.model.norm.weight), transforms,
        training={
            "command": "python scripts/train_exit_heads.py " + " ".join(sys.argv[1:]),
            "sequences": len(records), "held_out_sequences": num_held_out,
            "train_tokens": len(train_rows), "held_out_tokens": len(test_rows),
            "epochs": args.epochs, "lr": args.lr, "batch_tokens": args.batch_tokens,
            "max_tokens": args.max_tokens, "minutes": round(
                (time.perf_counter() - started) / 60, 1),
            "data": args.prompts_jsonl or f"HumanEval, MT-bench, GSM-style: "
                                          f"{args.num_prompts} each after the first "
                                          f"{BENCHMARK_PROMPTS}",
        },
        held_out={str(k): {"before": before[k], "after": after[k]}
                  for k in args.exit_layers},
        own_head_agreement_by_layer=[round(x, 4) for x in own],
    )
    plot_path = out / "agreement.png"
    plot(plot_path, name, own, {"after": after})
    print(f"\nexit heads for {name} -> {out}")
    print(f"{'E':>4}{'agree before':>14}{'agree after':>13}{'KL before':>11}{'KL after':>10}")
    for k in args.exit_layers:
        print(f"{k:>4}{before[k]['agreement']:>14.3f}{after[k]['agreement']:>13.3f}"
              f"{before[k]['kl']:>11.3f}{after[k]['kl']:>10.3f}")
    print(f"plot: {plot_path}")
    if args.install:
        shipped = CONFIGS_DIR / "heads" / name
        shutil.copytree(out, shipped, dirs_exist_ok=True)
        print(f"installed: {shipped}")
    else:
        print(f'use them with "heads": "{out}" (or --install to ship them)')


if __name__ == "__main__":
    main()
