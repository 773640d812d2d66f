"""vllm-selfspec: self-speculative decoding methods for vLLM.

`register` is the `vllm.general_plugins` entry point: vLLM calls it in every
process (front end, engine core, workers, Ray actors) before it builds configs.
"""

__version__ = "0.1.0"


def register() -> None:
    from vllm_selfspec.integration.patches import apply_patches

    apply_patches()
