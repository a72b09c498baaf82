"""The prompt formats llm-serving put a request's inputs in, by the served model's name (its
YAML's model_config.model_name): mindspore-ai/serving dev cfadf5a, examples/server_app_post.py
send_request, with the formats of mindspore_serving/serving_utils/constant.py. A Baichuan2
served there as ``baichuan2pa`` got its chat turn's markers (<reserved_106> user,
<reserved_107> assistant) around the text a client sent, an InternLM served as
``internlm_7b`` its own; scripts written against it send the bare question. Only its routes
(``/models/...``) do this, as there; the OpenAI routes take the prompt as sent.
"""
from __future__ import annotations

PROMPT_FORMATS = {
    "internlm_7b": "<s><s><|User|>:{}<eoh>\n<|Bot|>:",
    "baichuan2pa": "<reserved_106>{}<reserved_107>",
}


def llm_serving_prompt(model_name: str, inputs: str) -> str:
    """``inputs`` as llm-serving handed it to the model it served under ``model_name``."""
    fmt = PROMPT_FORMATS.get(model_name)
    return inputs if fmt is None else fmt.format(inputs)
