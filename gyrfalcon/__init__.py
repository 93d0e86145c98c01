"""gyrfalcon: an LLM inference and serving engine."""

from gyrfalcon.outputs import CompletionOutput, Logprob, RequestOutput
from gyrfalcon.sampling_params import SamplingParams, StructuredOutputsParams


def _version() -> str:
    """The installed distribution's version (pyproject.toml's, through `pip install`); a source tree used without
    installing it reports the version it was cut at."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("gyrfalcon")
    except PackageNotFoundError:
        return "0.1.0"


__version__ = _version()


def __getattr__(name):
    # LLM pulls in torch and transformers; importing the package for SamplingParams should not.
    if name == "LLM":
        from gyrfalcon.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "__version__"]
