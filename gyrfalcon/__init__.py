"""gyrfalcon: an LLM inference and serving engine."""

from gyrfalcon.outputs import CompletionOutput, Logprob, RequestOutput
from gyrfalcon.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in torch and transformers; importing the package for SamplingParams should not.
    if name == "LLM":
        from gyrfalcon.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
