"""One module per method: its config class (`CONFIG_CLASS`) and proposer
class (`PROPOSER_CLASS`), found by the method's name."""

from __future__ import annotations

import importlib
from types import ModuleType

from vllm_selfspec.config import METHOD_MODULES, SelfSpecConfig


def method_module(method: str) -> ModuleType:
    return importlib.import_module(METHOD_MODULES[method])


def config_class_for(method: str) -> type[SelfSpecConfig]:
    return method_module(method).CONFIG_CLASS
