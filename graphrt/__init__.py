"""graphrt: a graph-compiled LLM model runtime.

``graphrt.LLM`` serves a model; ``graphrt.SamplingParams`` says how each request samples.
Imports are lazy so that ``import graphrt.kernels`` stays light.
"""

from graphrt.version import __version__

__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__", "compile"]


def __getattr__(name: str):
    if name == "LLM":
        from graphrt.llm import LLM

        return LLM
    if name == "SamplingParams":
        from graphrt.sampling_params import SamplingParams

        return SamplingParams
    if name == "LoRARequest":
        from graphrt.lora.request import LoRARequest

        return LoRARequest
    if name == "compile":
        from graphrt.llm import compile

        return compile
    raise AttributeError(f"module 'graphrt' has no attribute {name!r}")
