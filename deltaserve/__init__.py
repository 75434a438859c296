"""deltaserve: a multi-process LLM inference engine.

    from deltaserve import LLM, SamplingParams
"""

from common.config import EngineConfig
from common.sampling_params import SamplingParams, StructuredOutputsParams
from frontend.client import EngineClient
from frontend.llm import LLM

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "EngineClient"]
