"""LoRA adapters served on one base model, as vLLM serves them (docs/lora.md).

- ``request.py``: ``LoRARequest``, vLLM's (``from llm_serving.lora.request import
  LoRARequest`` where vLLM scripts write ``from vllm.lora.request import LoRARequest``);
- ``peft.py``: a PEFT adapter directory, checked against the base model (master) and its
  weights read (WorkAgent);
- ``registry.py``: the adapters the engine knows, by id, and the checks a request's adapter
  passes before it is queued.

The compute is in ``model_executor/lora.py`` (the WorkAgent's adapters and each step's rows)
and ``layers/linear.py`` (each linear layer adds its adapters' products to their rows).
"""
from llm_serving.lora.request import LoRARequest  # noqa: F401
