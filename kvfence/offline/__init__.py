"""The offline API, vLLM's: `LLM` (llm.py), `SamplingParams` (params.py), and the outputs (outputs.py)."""

from kvfence.offline.llm import LLM
from kvfence.offline.outputs import CompletionOutput, Logprob, RequestOutput
from kvfence.offline.params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
