"""Write the settings tables of docs/settings.md and README.md from the config
classes, the one place each setting's meaning and default are stated.

A field's docstring is its meaning; its default is the docstring's closing
"Default: ..." sentence, else its value in `SelfSpecConfig.default_values()`,
else the field's own default, else "none". Tables sit between
`<!-- settings:NAME -->` and `<!-- /settings -->` markers; the prose around
them is the files' own.

    python scripts/settings_doc.py           # rewrite the tables
    python scripts/settings_doc.py --check   # exit 1 if a file is out of date
"""

from __future__ import annotations

import dataclasses
import json
import re

from doc_tables import rewrite_or_check
from vllm.config.utils import get_attr_docs

from vllm_selfspec.assets import ROOT
from vllm_selfspec.config import (
    COMMON_FIELDS,
    LOOKUP_OPTIONS,
    METHOD_MODULES,
    SelfSpecConfig,
)
from vllm_selfspec.proposers import config_class_for

FILES = (ROOT / "docs" / "settings.md", ROOT / "README.md")
BLOCK = re.compile(r"(<!-- settings:([\w-]+) -->\n)(.*?)(<!-- /settings -->)", re.S)
HEADER = "| key | default | meaning |\n|---|---|---|\n"
NUM_SPECULATIVE_TOKENS = "The most drafts per round."


def _code(value) -> str:
    return f"`{json.dumps(value)}`"


def _meaning_and_default(cls: type[SelfSpecConfig], name: str) -> tuple[str, str]:
    doc = " ".join(get_attr_docs(cls)[name].split())
    stated = re.search(r"\s*Default: (.*?)\.?$", doc)
    if stated:
        return doc[:stated.start()], stated.group(1)
    values = cls.default_values()
    if name in values:
        return doc, _code(values[name])
    default = cls.__dataclass_fields__[name].default
    if default is not dataclasses.MISSING and default is not None:
        return doc, _code(default)
    return doc, "none"


def _row(key: str, default: str, meaning: str) -> str:
    return f"| `{key}` | {default} | {meaning} |\n"


def common_table(short: bool) -> str:
    """Keys every method takes; `short`: each meaning's first sentence."""
    rows = []
    for name in ("config_file", *COMMON_FIELDS, "draft_sample_method"):
        meaning, default = _meaning_and_default(SelfSpecConfig, name)
        if short:
            meaning = re.split(r"(?<=\.)\s", meaning, maxsplit=1)[0]
        rows.append(_row(name, default, meaning))
        if name == "lookup" and not short:
            rows += [_row(f"lookup.{key}", _code(option.default), option.doc)
                     for key, option in LOOKUP_OPTIONS.items()]
    rows.append(_row("num_speculative_tokens", "per method", NUM_SPECULATIVE_TOKENS))
    return HEADER + "".join(rows)


def method_table(method: str) -> str:
    cls = config_class_for(method)
    rows = [_row(name, default, meaning) for name in cls.own_fields()
            for meaning, default in [_meaning_and_default(cls, name)]]
    rows.append(_row("num_speculative_tokens", _code(cls.default_num_speculative_tokens),
                     NUM_SPECULATIVE_TOKENS))
    return HEADER + "".join(rows)


def table(name: str) -> str:
    if name in ("common", "common-short"):
        return common_table(short=name == "common-short")
    if name in METHOD_MODULES:
        return method_table(name)
    raise SystemExit(f"unknown settings table '{name}'")


def render(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + table(m.group(2)) + m.group(4), text)


def main() -> None:
    rewrite_or_check(__doc__.splitlines()[0], FILES, render, "settings_doc.py")


if __name__ == "__main__":
    main()
