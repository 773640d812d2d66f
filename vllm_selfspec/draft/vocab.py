"""Draft vocabularies: the tokens a reduced draft LM head keeps.

A file (`vllm_selfspec/configs/vocab/<model>.json`, written by `scripts/build_draft_vocab.py`)
ranks the tokens the model itself generated greedily on calibration prompts,
most frequent first, and says which model it was made for (the same identity
exit heads carry: shapes and the final norm's hash) and how much of held-out
generated text the recommended size covers. `draft_vocab` in a speculative
config names such a file, or gives a size N and takes the top N of the file
shipped for the target model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_selfspec.assets import CONFIGS_DIR

VOCAB_FORMAT = "vllm-selfspec-draft-vocab/1"


class DraftVocabError(ValueError):
    """A vocabulary file that does not fit; the message names the field and fix."""


def vocab_dir() -> Path:
    return CONFIGS_DIR / "vocab"


@dataclass(frozen=True)
class DraftVocab:
    path: Path
    meta: dict[str, Any]

    @property
    def ranked(self) -> list[int]:
        return list(self.meta["token_ids"])

    @property
    def size(self) -> int:
        """The recommended number of tokens (what the coverage figure is for)."""
        return int(self.meta["size"])

    @classmethod
    def open(cls, location: str) -> DraftVocab:
        path = Path(location)
        if not path.is_file():
            for candidate in (vocab_dir() / location, vocab_dir() / f"{location}.json"):
                if candidate.is_file():
                    path = candidate
                    break
            else:
                raise DraftVocabError(
                    f"speculative_config.draft_vocab: no file '{location}' (nor under "
                    f"{vocab_dir()}); build one with scripts/build_draft_vocab.py or "
                    "give a shipped name.")
        try:
            meta = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise DraftVocabError(
                f"speculative_config.draft_vocab: cannot read {path} ({error}); "
                "rebuild it with scripts/build_draft_vocab.py.") from error
        if not isinstance(meta, dict) or meta.get("format") != VOCAB_FORMAT:
            raise DraftVocabError(
                f"speculative_config.draft_vocab: {path} is not a draft vocabulary of "
                f"format {VOCAB_FORMAT}; rebuild it with scripts/build_draft_vocab.py.")
        return cls(path, meta)

    def token_ids(self, size: int | None) -> list[int]:
        size = self.size if size is None else size
        ranked = self.ranked
        if not 1 <= size <= len(ranked):
            raise DraftVocabError(
                f"speculative_config.draft_vocab_size: {size} is outside 1..{len(ranked)}, "
                f"the tokens {self.path} ranks; choose a size in that range.")
        return ranked[:size]

    def check(self, identity: dict[str, Any]) -> None:
        """The file must be for this model: same vocabulary, same weights."""
        made_for = self.meta["model"]
        if made_for["vocab_size"] != identity["vocab_size"]:
            raise DraftVocabError(
                f"speculative_config.draft_vocab: {self.path} was made for a vocabulary "
                f"of {made_for['vocab_size']} tokens, the target has "
                f"{identity['vocab_size']}; build one for this model with "
                "scripts/build_draft_vocab.py.")
        if made_for["final_norm_sha256"] != identity["final_norm_sha256"]:
            raise DraftVocabError(
                f"speculative_config.draft_vocab: {self.path} was made for "
                f"{made_for.get('name', 'another model')}, whose weights differ from the "
                "target's (final-norm hash mismatch); build one for this model with "
                "scripts/build_draft_vocab.py.")


def shipped_for(identity: dict[str, Any]) -> DraftVocab:
    """The shipped vocabulary made for the model with this identity."""
    for path in sorted(vocab_dir().glob("*.json")):
        vocab = DraftVocab.open(str(path))
        if vocab.meta["model"]["final_norm_sha256"] == identity["final_norm_sha256"]:
            return vocab
    raise DraftVocabError(
        "speculative_config.draft_vocab: no shipped vocabulary under "
        f"{vocab_dir()} was made for this model; build one with "
        "scripts/build_draft_vocab.py and give its path.")


def save_vocab(out: Path, name: str, identity: dict[str, Any], ranked: list[int],
               size: int, **record: Any) -> None:
    """Write a vocabulary file; `record` (coverage, how it was made) goes in too."""
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": VOCAB_FORMAT, "model": {"name": name, **identity}, "size": size,
            **record}
    text = json.dumps(meta, indent=1)
    # The ranked ids on one line, so the file stays readable.
    out.write_text(text[:-2] + ',\n "token_ids": ' + json.dumps(ranked) + "\n}\n")
