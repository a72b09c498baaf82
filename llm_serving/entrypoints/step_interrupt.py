"""Ctrl-C in ``LLM.generate``: taken at the next step boundary, so the LLM stays usable.

A KeyboardInterrupt raised inside a step can leave the engine and its WorkAgents out of step
with each other (a step the agents answer that the engine no longer waits for: the next
generate fails or hangs). While ``LLM.generate`` runs, a first Ctrl-C is noted and raised
once the step running ends (``raise_pending``), before the LLM aborts the requests of the
interrupted call; a second one raises at once (a hung step), at the cost of that guarantee.
Only in the main thread, and only over Python's default SIGINT handler (a program with its
own keeps it).
"""
from __future__ import annotations

import signal
import threading


class StepInterrupt:
    def __init__(self):
        self.pending = False
        self._previous = None

    def __enter__(self) -> "StepInterrupt":
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous = signal.signal(signal.SIGINT, self._note)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        if exc_type is None:
            self.raise_pending()       # a Ctrl-C while the call was ending

    def _note(self, signum, frame) -> None:
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True

    def raise_pending(self) -> None:
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt
