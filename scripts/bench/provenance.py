"""Which code, machine and day a result came from: every result file records
it, and the run tables of docs/results/ are written from it
(`scripts/results_pages.py`)."""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

from vllm_selfspec.assets import ROOT, cpu_flags


def cpu_model() -> str:
    """The CPU's model name, as the kernel reports it."""
    cpuinfo = Path("/proc/cpuinfo")
    for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else []):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def code_version() -> str:
    """The commit the run's code is at, and whether the checkout had changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "not a git checkout"
    return commit + (" with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no")
                     else "")


def provenance() -> dict:
    """The keys every result file opens with."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "code": code_version(), "cpu": cpu_model(), "cpu_flags": list(cpu_flags())}
