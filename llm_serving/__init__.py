"""llm_serving: LLM inference serving on MindSpore."""
from llm_serving.outputs import CompletionOutput, RequestOutput  # noqa: F401
from llm_serving.sampling_params import SamplingParams  # noqa: F401

__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in MindSpore, which takes seconds to import: load it on first use.
    if name == "LLM":
        from llm_serving.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)
