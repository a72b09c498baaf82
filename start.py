#!/usr/bin/env python
"""Start llm_serving with a config file: ``python start.py --config configs/llama/<name>.yaml``.

With no arguments it uses the built-in tiny default, generating its random-weight model on
first use. Until the HTTP server lands (issues 4-5), it runs the configured model offline on
a few prompts and prints the results.
"""
from llm_serving.cli import main

if __name__ == "__main__":
    main(["serve", *__import__("sys").argv[1:]])
