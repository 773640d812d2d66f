"""Installed as users install it: the built wheel, non-editable, in a fresh
environment (reusing this one's vLLM and torch through a path file), run from
outside the checkout. Every shipped file is in the wheel, every SmolLM2 name
(vocabulary, exit heads, skip-set config file) resolves there, and an engine
with the README's recommended setting starts and drafts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from vllm_selfspec.assets import CONFIGS_DIR, ROOT

# Run by the fresh environment's Python, from a directory outside the checkout.
CHECK = """
import json, sys
from pathlib import Path
import vllm_selfspec
from vllm.engine.arg_utils import EngineArgs

model, fresh = sys.argv[1], sys.argv[2]
assert Path(vllm_selfspec.__file__).resolve().is_relative_to(fresh), vllm_selfspec.__file__
from importlib.metadata import distribution, requires
assert Path(distribution("vllm-selfspec")._path).resolve().is_relative_to(fresh)
declared = " ".join(requires("vllm-selfspec"))
for needed in ("bayesian-optimization", "numpy", "safetensors"):  # imported at run time
    assert needed in declared, declared
# Each method by its name finds the wheel's shipped heads and vocabulary.
for method, heads in (("adadecode", "smollm2-135m"), ("del", "smollm2-135m-del")):
    spec = EngineArgs(model=model, dtype="float32", max_model_len=512,
                      speculative_config={"method": method}).create_engine_config(
                      ).speculative_config
    assert Path(spec.heads).resolve() == Path(vllm_selfspec.__file__).parent.resolve(
        ) / "configs" / "heads" / heads, spec.heads
    assert Path(spec.draft_vocab).name == "smollm2-135m.json", spec.draft_vocab
EngineArgs(model=model, dtype="float32", max_model_len=512, speculative_config={
    "method": "draft_verify", "config_file": "smollm2-135m"}).create_engine_config()
from vllm import LLM, SamplingParams
llm = LLM(model=model, dtype="float32", max_model_len=512, enforce_eager=True,
          speculative_config={"method": "draft_verify", "cost_aware": False},
          per_request_spec_decode_metrics="summary")
(output,) = llm.generate(["def fibonacci(n):"], SamplingParams(
    temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
metrics = output.outputs[0].spec_decode_metrics
print("REPORT", json.dumps({"tokens": len(output.outputs[0].token_ids),
                  "drafted": metrics.num_draft_tokens,
                  "sources": metrics.token_sources}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(out)], check=True)
    (built,) = out.glob("vllm_selfspec-*.whl")
    return built


def test_the_wheel_ships_every_vocabulary_head_and_skip_set(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"vllm_selfspec/configs/{path.relative_to(CONFIGS_DIR).as_posix()}"
               for path in CONFIGS_DIR.rglob("*") if path.is_file()}
    assert {"vllm_selfspec/configs/vocab/smollm2-135m.json",
            "vllm_selfspec/configs/smollm2-135m.json",
            "vllm_selfspec/configs/heads/smollm2-135m/heads.safetensors"} <= shipped
    assert shipped <= names, sorted(shipped - names)


def test_a_fresh_environment_with_the_wheel_serves_the_shipped_names(wheel, model_dir,
                                                                     tmp_path):
    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True)
    python = fresh / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # This environment's packages (vLLM, torch, the plugin's dependencies), not
    # its editable plugin: a path file adds the directory, not its .pth hooks.
    Path(site, "reuse-test-environment.pth").write_text(sysconfig.get_path("purelib") + "\n")
    # No dependencies fetched (they are this environment's; CHECK reads the
    # wheel's declared ones), and not "already satisfied" by the editable install.
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                    "-q", "--no-deps", "--force-reinstall", str(wheel)], check=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([python, "-c", CHECK, str(model_dir), str(fresh.resolve())],
                            cwd=outside, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    report = json.loads(line.removeprefix("REPORT "))
    assert report["tokens"] == 24 and report["drafted"] > 0, report
    assert report["sources"]["self_drafted"] > 0, report  # the int8, reduced-vocabulary draft
