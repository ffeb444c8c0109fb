"""kvforge: KV-cache reshaping for LLM inference (SwiftKV, KIVI, ShadowKV on one engine)."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "StructuredOutputs"]


def __getattr__(name: str):
    # Lazy, so `import kvforge` stays cheap for tools that only need a submodule.
    if name == "LLM":
        from kvforge.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvforge.engine.sampling import SamplingParams

        return SamplingParams
    if name == "StructuredOutputs":
        from kvforge.engine.structured_output import StructuredOutputs

        return StructuredOutputs
    raise AttributeError(name)
