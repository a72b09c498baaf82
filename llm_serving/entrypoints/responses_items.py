"""A response's output items, built from the answer's pieces as they come, with the events
that stream them, as vLLM 0.32's SimpleStreamingEventProcessor does: one item is open at a
time; a piece of another kind (or another call) closes it and opens the next, each at the
next output_index.

- the message: response.output_item.added, response.content_part.added,
  response.output_text.delta..., response.output_text.done, response.content_part.done,
  response.output_item.done;
- the reasoning (``--reasoning-parser``): response.output_item.added,
  response.content_part.added, response.reasoning_text.delta...,
  response.reasoning_text.done, response.content_part.done, response.output_item.done;
- a function call: response.output_item.added (its name and call_id, arguments ""),
  response.function_call_arguments.delta..., response.function_call_arguments.done,
  response.output_item.done.

Each event is (type, fields) without its sequence_number, which the route numbers.
"""
from __future__ import annotations

import uuid
from typing import Optional


def text_part(text: str, logprobs: Optional[list] = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def message(item_id: str, text: str, status: str, logprobs: Optional[list] = None) -> dict:
    """The output message item (no content part for an empty text, as vLLM)."""
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text, logprobs)] if text else [], "phase": None}


def function_call(item_id: str, call_id: str, name: str, arguments: str,
                  status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status, "namespace": None}


def reasoning_item(item_id: str, text: Optional[str], status: Optional[str]) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": None if text is None else [{"type": "reasoning_text", "text": text}],
            "encrypted_content": None, "status": status}


def delta_logprobs(entries: list) -> list:
    """A delta event's logprobs: as the output text's, without bytes (OpenAI's shape)."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                              for t in e["top_logprobs"]]} for e in entries]


class OutputItems:
    """The output items of one answer: ``done`` holds the finished ones, in order."""

    def __init__(self):
        self.done: list[dict] = []
        self.kind: Optional[str] = None     # the open item's type
        self.item: dict = {}
        self.text: list[str] = []
        self.scored: list = []
        self.call_index: Optional[int] = None

    def reasoning(self, text: str) -> list:
        """The reasoning grows by ``text``."""
        events = [] if self.kind == "reasoning" else self.close() + self._open_reasoning()
        self.text.append(text)
        return events + [("response.reasoning_text.delta", {
            "item_id": self.item["id"], **self._at(), "content_index": 0, "delta": text})]

    def content(self, text: str, logprobs: Optional[list] = None) -> list:
        """The message's text grows by ``text`` (with its tokens' logprobs, when asked)."""
        events = [] if self.kind == "message" else self.close() + self._open_message()
        self.text.append(text)
        self.scored.extend(logprobs or [])
        return events + [("response.output_text.delta", {
            "item_id": self.item["id"], **self._at(), "content_index": 0, "delta": text,
            "logprobs": delta_logprobs(logprobs or [])})]

    def call(self, delta: dict) -> list:
        """A chat tool-call delta (``tool_calls.ChoiceStream``'s): with an ``id`` it starts
        a call, else its arguments grow."""
        events = []
        if "id" in delta or self.kind != "function_call" or delta["index"] != self.call_index:
            fn = delta.get("function") or {}
            events = self.close() + self._open_call(delta.get("id") or _call_id(),
                                                    fn.get("name") or "", delta["index"])
        args = (delta.get("function") or {}).get("arguments")
        if args:
            self.text.append(args)
            events.append(("response.function_call_arguments.delta", {
                "item_id": self.item["id"], **self._at(), "delta": args}))
        return events

    def close(self) -> list:
        """Finish the open item, if any."""
        kind, item, text = self.kind, self.item, "".join(self.text)
        self.kind, self.item, self.text = None, {}, []
        if kind == "message":
            scored, self.scored = self.scored or None, []
            done = message(item["id"], text, "completed", scored)
            events = [("response.output_text.done", {"item_id": item["id"], **self._at(),
                                                       "content_index": 0, "text": text,
                                                       "logprobs": []}),
                      ("response.content_part.done", {"item_id": item["id"], **self._at(),
                                                        "content_index": 0,
                                                        "part": text_part(text, scored)})]
        elif kind == "reasoning":
            done = reasoning_item(item["id"], text, "completed")
            part = {"type": "reasoning_text", "text": text}
            events = [("response.reasoning_text.done", {"item_id": item["id"], **self._at(),
                                                         "content_index": 0, "text": text}),
                      ("response.content_part.done", {"item_id": item["id"], **self._at(),
                                                        "content_index": 0, "part": part})]
        elif kind == "function_call":
            done = {**item, "arguments": text, "status": "completed"}
            events = [("response.function_call_arguments.done", {
                "item_id": item["id"], **self._at(), "arguments": text,
                "name": item["name"]})]
        else:
            return []
        events.append(("response.output_item.done", {**self._at(), "item": done}))
        self.done.append(done)
        return events

    def _at(self) -> dict:
        return {"output_index": len(self.done)}

    def _open_reasoning(self) -> list:
        self.kind = "reasoning"
        self.item = reasoning_item(f"rs_{uuid.uuid4().hex}", None, "in_progress")
        return [("response.output_item.added", {**self._at(), "item": self.item}),
                ("response.content_part.added", {"item_id": self.item["id"], **self._at(),
                                                 "content_index": 0,
                                                 "part": {"type": "reasoning_text",
                                                          "text": ""}})]

    def _open_message(self) -> list:
        self.kind, self.item = "message", message(f"msg_{uuid.uuid4().hex}", "", "in_progress")
        return [("response.output_item.added", {**self._at(), "item": self.item}),
                ("response.content_part.added", {"item_id": self.item["id"], **self._at(),
                                                 "content_index": 0,
                                                 "part": {**text_part(""), "logprobs": []}})]

    def _open_call(self, call_id: str, name: str, index: int) -> list:
        self.kind, self.call_index = "function_call", index
        self.item = function_call(f"fc_{uuid.uuid4().hex}", call_id, name, "", "in_progress")
        return [("response.output_item.added", {**self._at(), "item": self.item})]


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
