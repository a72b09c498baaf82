"""llm_serving: LLM inference serving on MindSpore."""
import os as _os

# The CPU kernels' OpenMP threads must not spin long after a kernel ends: a spinning thread
# takes a core from the MindSpore matmul that runs next (B=16 decode went 124 ms -> 1150 ms).
# libgomp reads this once, when it loads, so it is set before MindSpore is imported.
_os.environ.setdefault("GOMP_SPINCOUNT", "50000")
from llm_serving.outputs import (ClassificationOutput,  # noqa: F401
                                 ClassificationRequestOutput, CompletionOutput,
                                 EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput,
                                 PoolingRequestOutput, RequestOutput,
                                 ScoringOutput, ScoringRequestOutput)
from llm_serving.pooling_params import PoolingParams  # noqa: F401
from llm_serving.sampling_params import (BeamSearchParams, RequestOutputKind,  # noqa: F401
                                         SamplingParams)
from llm_serving.config import AsyncEngineArgs, EngineArgs  # noqa: F401
from llm_serving.inputs import EmbedsPrompt, TextPrompt, TokensPrompt  # noqa: F401
from llm_serving.lora.request import LoRARequest  # noqa: F401

__version__ = "0.1.0"
__all__ = ["AsyncEngineArgs", "AsyncLLMEngine", "BeamSearchParams", "ClassificationOutput",
           "EmbedsPrompt",
           "ClassificationRequestOutput", "CompletionOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "EngineArgs", "LLM", "LLMEngine", "LoRARequest",
           "PoolingOutput", "PoolingParams", "PoolingRequestOutput", "RequestOutput",
           "RequestOutputKind", "SamplingParams", "ScoringOutput", "ScoringRequestOutput",
           "TextPrompt", "TokensPrompt", "__version__"]


def __getattr__(name):
    # These pull in MindSpore, which takes seconds to import: load them on first use.
    if name == "LLM":
        from llm_serving.entrypoints.llm import LLM
        return LLM
    if name == "LLMEngine":
        from llm_serving.engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "AsyncLLMEngine":
        from llm_serving.engine.async_engine import AsyncLLMEngine
        return AsyncLLMEngine
    raise AttributeError(name)
