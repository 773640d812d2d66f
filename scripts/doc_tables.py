"""Tables in the docs that a script writes from their one source: rewrite them,
or with `--check` only say which files are out of date."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from vllm_selfspec.assets import ROOT


def rewrite_or_check(description: str, files: Iterable[Path], render: Callable[[str], str],
                     script: str) -> None:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 naming each file that is out of date")
    args = parser.parse_args()
    stale = []
    for path in files:
        text = path.read_text()
        rendered = render(text)
        if rendered != text:
            stale.append(path)
            if not args.check:
                path.write_text(rendered)
    if args.check and stale:
        sys.exit(f"out of date (run python scripts/{script}): "
                 + ", ".join(str(Path(p).relative_to(ROOT)) for p in stale))
