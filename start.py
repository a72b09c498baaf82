#!/usr/bin/env python
"""Start llm_serving with a config file: ``python start.py --config configs/llama/<name>.yaml``.

With no arguments it serves the built-in tiny default, generating its random-weight model on
first use. ``python start.py --help`` lists every option; it is ``llm-serving serve``.
"""
from llm_serving.cli import main

if __name__ == "__main__":
    main(["serve", *__import__("sys").argv[1:]])
