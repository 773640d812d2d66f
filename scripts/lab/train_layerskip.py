"""LayerSkip-style fine-tuning on the CPU: teach a model's own LM head to exit early.

DEL picks its exit layer by tokens per loaded layer, so the exit moves only on
models whose own early exits are good and get better with depth: LayerSkip
models (Elhoushi et al., 2024). None is on PyPI, so this script makes one from
a vanilla model with low-rank adapters (LoRA) on every decoder projection,
trained by self-distillation on the model's own greedy answers (the AdaDecode
heads' data, `scripts/train_exit_heads.py` stage 1):

    loss = KL(p_base || p_final) + s sum_E E KL(p_base || p_exit E) / sum_E E

p_base is the untouched model's final distribution (adapters off), p_exit E the
tuned model's own LM head after E layers; the weight grows with depth as in
LayerSkip's early-exit loss, s (`--exit-loss-scale`) keeps the final output
close to the base model's, and the exits trained in a step rotate through the
candidates (LayerSkip's rotational curriculum) to bound the LM-head cost.
Merges the adapters into models/<model>-layerskip (a normal model directory for
vLLM: `{"method": "del", "exit_layer_stride": 2}` with no heads) and writes the
held-out agreement of the own LM head at every layer, per prompt set, before and
after, to runs/<model>-layerskip.json and .png.

    python scripts/lab/train_layerskip.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize
from tqdm import tqdm
from train_exit_heads import BENCHMARK_PROMPTS, generate_data, model_path

from vllm_selfspec.assets import RESULTS_DIR as RESULTS
from vllm_selfspec.assets import ROOT, fast_dtype

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SETS = ("code", "chat", "math")  # the order generate_data's prompts come in


class LowRankUpdate(nn.Module):
    """Parametrization W -> W + (alpha / r) B A; B starts at zero, so training
    starts from the base model, and `enabled = False` gives the base back."""

    def __init__(self, out_features: int, in_features: int, rank: int, alpha: float):
        super().__init__()
        self.down = nn.Parameter(torch.randn(rank, in_features) / math.sqrt(in_features))
        self.up = nn.Parameter(torch.zeros(out_features, rank))
        self.scale = alpha / rank
        self.enabled = True

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.scale * self.up @ self.down if self.enabled else weight


def add_adapters(model, rank: int, alpha: float) -> dict[str, LowRankUpdate]:
    updates = {}
    for name, module in model.model.layers.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            update = LowRankUpdate(*module.weight.shape, rank, alpha)
            parametrize.register_parametrization(module, "weight", update)
            updates[f"layers.{name}"] = update
    return updates


def set_adapters(updates: dict[str, LowRankUpdate], enabled: bool) -> None:
    for update in updates.values():
        update.enabled = enabled


def exit_log_probs(model, hidden: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.model.norm(hidden)).log_softmax(-1)


def rotation(candidates: list[int], period: int, step: int) -> list[int]:
    """The exits trained at `step`: every `period`-th candidate, shifted each step."""
    return candidates[step % period::period]


def kl(target: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    return F.kl_div(log_probs, target, log_target=True, reduction="batchmean")


def train(model, updates, records, train_ids: list[int], args) -> None:
    params = [p for u in updates.values() for p in u.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    steps = math.ceil(len(train_ids) / args.sequences_per_step) * args.epochs
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(
        (s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0)))))
    order, step = random.Random(0), 0
    progress = tqdm(total=steps, desc="LayerSkip fine-tune")
    for _ in range(args.epochs):
        ids = list(train_ids)
        order.shuffle(ids)
        for start in range(0, len(ids), args.sequences_per_step):
            exits = rotation(args.exit_layers, args.rotation, step)
            total = {"final": 0.0, "exits": 0.0}
            for index in ids[start:start + args.sequences_per_step]:
                prompt_ids, answer_ids = records[index]
                tokens = torch.tensor([prompt_ids + answer_ids])
                first, last = len(prompt_ids) - 1, len(prompt_ids) + len(answer_ids) - 1
                with torch.no_grad():
                    set_adapters(updates, False)
                    base = model(tokens).logits[0, first:last].log_softmax(-1)
                    set_adapters(updates, True)
                outputs = model(tokens, output_hidden_states=True)
                hidden = outputs.hidden_states  # the last one is already normed
                final = kl(base, outputs.logits[0, first:last].log_softmax(-1))
                early = args.exit_loss_scale * sum(e * kl(base, exit_log_probs(
                    model, hidden[e][0, first:last])) for e in exits) / sum(exits)
                ((final + early) / args.sequences_per_step).backward()
                total["final"] += final.item()
                total["exits"] += float(early)
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
            step += 1
            progress.update()
            progress.set_postfix(kl_final=f"{total['final'] / args.sequences_per_step:.3f}",
                                 kl_exits=f"{total['exits'] / args.sequences_per_step:.3f}")
    progress.close()


@torch.no_grad()
def agreement_by_set(model, updates, records, held_out: list[int], num_prompts: int
                     ) -> dict[str, list[float]]:
    """Per prompt set: top-1 agreement of the own LM head after each layer with
    the same model's final output, and ('base') of the final output with the
    untouched model's."""
    hits = {name: torch.zeros(model.config.num_hidden_layers) for name in SETS}
    counts = dict.fromkeys(SETS, 0)
    for index in tqdm(held_out, desc="held-out agreement"):
        prompt_ids, answer_ids = records[index]
        tokens = torch.tensor([prompt_ids + answer_ids])
        first, last = len(prompt_ids) - 1, len(prompt_ids) + len(answer_ids) - 1
        set_adapters(updates, False)
        base = model(tokens).logits[0, first:last].argmax(-1)
        set_adapters(updates, True)
        outputs = model(tokens, output_hidden_states=True)
        hidden = outputs.hidden_states
        final = outputs.logits[0, first:last].argmax(-1)
        name = SETS[min(index // num_prompts, len(SETS) - 1)]
        for layer in range(1, len(hidden) - 1):
            hits[name][layer - 1] += (exit_log_probs(
                model, hidden[layer][0, first:last]).argmax(-1) == final).sum()
        hits[name][-1] += (final == base).sum()
        counts[name] += last - first
    return {name: (hits[name] / max(counts[name], 1)).tolist() for name in SETS}


def save_model(model, updates, base_dir: Path, out_dir: Path, record: dict) -> None:
    """Merge the adapters into the weights and write a model directory vLLM loads."""
    for name in updates:
        parametrize.remove_parametrizations(model.model.layers.get_submodule(
            name.removeprefix("layers.")), "weight", leave_parametrized=True)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.save_pretrained(out_dir)
    for path in base_dir.iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "generation_config")):
            shutil.copy(path, out_dir / path.name)
    (out_dir / "PROVENANCE.json").write_text(json.dumps(
        {"base": base_dir.name, "made_by": record["command"]}, indent=2))


def plot(path: Path, name: str, before: dict, after: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 4))
    for color, set_name in zip(("tab:blue", "tab:orange", "tab:green"), SETS):
        layers = range(1, len(after[set_name]))
        axis.plot(layers, before[set_name][:-1], ":", color=color, alpha=0.7)
        axis.plot(layers, after[set_name][:-1], "o-", ms=3, color=color,
                  label=f"{set_name} (final = base: {after[set_name][-1]:.2f})")
    axis.set_xlabel("exit layer E (layers run), own LM head")
    axis.set_ylabel("held-out top-1 agreement with the final layer")
    axis.set_ylim(0, 1.02)
    axis.set_title(f"{name}: before (dotted) and after LayerSkip fine-tuning")
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="name under models/ or a path")
    parser.add_argument("--exit-layers", help="trained exits (default every 2nd layer)")
    parser.add_argument("--rotation", type=int, default=4,
                        help="train every n-th exit per step, shifting each step")
    parser.add_argument("--exit-loss-scale", type=float, default=0.5,
                        help="weight of the early exits' loss against the final output's")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--num-prompts", type=int, default=64, help="per prompt set")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--sequences-per-step", type=int, default=4)
    parser.add_argument("--dtype", default=fast_dtype(),
                        help="of the data-generating engine (bfloat16 where native, else float32)")
    args = parser.parse_args()
    args.prompts_jsonl = None  # generate_data's prompt sets, in SETS order
    started = time.perf_counter()
    torch.manual_seed(0)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    base_dir = model_path(args.model)
    name = base_dir.name
    out_dir = base_dir.parent / f"{name}-layerskip"
    from transformers import AutoModelForCausalLM

    workdir = ROOT / ".cache" / "layerskip" / name
    workdir.mkdir(parents=True, exist_ok=True)
    records = generate_data(args, base_dir, workdir / "data.json")
    model = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    model.requires_grad_(False)
    num_layers = model.config.num_hidden_layers
    args.exit_layers = ([int(x) for x in args.exit_layers.split(",")] if args.exit_layers
                        else list(range(2, num_layers, 2)))
    updates = add_adapters(model, args.rank, args.alpha)
    held_out = [i for i in range(len(records)) if i % 10 == 9 and records[i][1]]
    train_ids = [i for i in range(len(records)) if i % 10 != 9 and records[i][1]]

    set_adapters(updates, False)
    before = agreement_by_set(model, updates, records, held_out, args.num_prompts)
    set_adapters(updates, True)
    model.train()
    train(model, updates, records, train_ids, args)
    model.eval()
    after = agreement_by_set(model, updates, records, held_out, args.num_prompts)
    record = {
        "command": "python scripts/lab/train_layerskip.py " + " ".join(sys.argv[1:]),
        "data": f"own greedy answers (max {args.max_tokens} tokens) to HumanEval, MT-bench, "
                f"GSM-style: {args.num_prompts} each after the first {BENCHMARK_PROMPTS}",
        "train_sequences": len(train_ids), "held_out_sequences": len(held_out),
        "exit_loss_scale": args.exit_loss_scale, "rank": args.rank, "alpha": args.alpha,
        "epochs": args.epochs, "lr": args.lr,
        "exit_layers": args.exit_layers, "rotation": args.rotation,
        "minutes": round((time.perf_counter() - started) / 60, 1),
        "held_out_agreement_by_layer": {
            "note": "own LM head after E layers vs the final layer, per prompt set; "
                    "the last entry: final output vs the base model's",
            "before": {k: [round(x, 3) for x in v] for k, v in before.items()},
            "after": {k: [round(x, 3) for x in v] for k, v in after.items()}},
    }
    save_model(model, updates, base_dir, out_dir, record)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}-layerskip.json").write_text(json.dumps(record, indent=2))
    plot(RESULTS / f"{name}-layerskip.png", name, before, after)
    print(f"model: {out_dir}; runs/{name}-layerskip.json and .png")
    print(f"{'E':>4}" + "".join(f"{s + ' before':>13}{s + ' after':>12}" for s in SETS))
    for layer in range(num_layers):
        label = "base" if layer == num_layers - 1 else str(layer + 1)
        print(f"{label:>4}" + "".join(f"{before[s][layer]:>13.3f}{after[s][layer]:>12.3f}"
                                      for s in SETS))


if __name__ == "__main__":
    main()
