"""llm-serving's layout keeps its agents here; the WorkAgent itself lives in the package
(``llm_serving/executor/worker.py``). ``python agents/work_agent.py ...`` runs it."""
from llm_serving.executor.worker import _exit, main

if __name__ == "__main__":
    _exit(main())
