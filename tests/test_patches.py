"""The patch list matches the installed vLLM and is applied exactly once."""

from __future__ import annotations

import pytest
import vllm

from vllm_selfspec import patches


def test_every_patch_target_exists_in_vllm():
    for patch in patches.PATCHES:
        assert hasattr(patch.target(), patch.attribute), patch
        assert callable(patch.resolve_replacement()), patch


def test_patches_are_applied_once_and_originals_kept():
    patches.apply_patches()
    applied = dict(patches.ORIGINALS)
    assert len(applied) == len(patches.PATCHES)
    patches.apply_patches()  # a second call (another plugin load) changes nothing
    assert patches.ORIGINALS == applied
    for patch in patches.PATCHES:
        current = patch.target().__dict__[patch.attribute]
        assert getattr(current, "__func__", current) is patch.resolve_replacement()


def test_other_vllm_versions_are_refused(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.x only and found "
                                           r"vLLM 0\.33\.0; install vllm==0\.32\.0"):
        patches.check_vllm_version()
