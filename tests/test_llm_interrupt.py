"""Ctrl-C in ``LLM.generate`` with WorkAgents (one, and two tensor-parallel ranks): wherever
it lands in a step (here: sent while the master waits for a step's answer, after it took the
step off its outstanding list; while it hands a step over; while it processes the samples),
the call ends with KeyboardInterrupt and the next generate gives the same tokens as before.
It used to lose the step whose answer was being read, and the next generate failed with
"a WorkAgent answered step N while step N+1 was expected"."""
from __future__ import annotations

import os
import signal

import pytest

from llm_serving import LLM, SamplingParams
from llm_serving.engine.output_processor import OutputProcessor
from llm_serving.executor.multiproc_executor import MultiprocExecutor

PROMPTS = ["Hello there", "The capital of France is", "One two three"]
POINTS = [(MultiprocExecutor, "_wait_all"), (MultiprocExecutor, "submit"),
          (OutputProcessor, "process")]


@pytest.mark.parametrize("tp", [1, 2])
def test_an_interrupted_generate_leaves_the_llm_usable(tiny_model_dir, monkeypatch, tp):
    llm = LLM(tiny_model_dir, distributed_executor_backend="mp", num_blocks=128,
              tensor_parallel_size=tp)
    try:
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
        for cls, name in POINTS:
            for nth in (1, 4):
                original, calls = getattr(cls, name), []

                def ctrl_c_inside(self, *args, _original=original, _nth=nth, **kwargs):
                    calls.append(1)
                    if len(calls) == _nth:
                        os.kill(os.getpid(), signal.SIGINT)
                    return _original(self, *args, **kwargs)
                monkeypatch.setattr(cls, name, ctrl_c_inside)
                with pytest.raises(KeyboardInterrupt):
                    llm.generate(PROMPTS, sp)
                monkeypatch.setattr(cls, name, original)
                got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
                assert got == ref, (name, nth)
        assert llm.engine.get_num_unfinished_requests() == 0
    finally:
        llm.engine.shutdown()
