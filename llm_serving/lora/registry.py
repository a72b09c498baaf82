"""The adapters the engine knows (master side): each request's ``LoRARequest`` is checked
here before it is queued, its adapter read and checked once per id and path
(``peft.read_adapter``: its config checked, its weights read), and the adapters
served by name (``--lora-modules``, and those loaded at run time) are kept by name for the
HTTP routes."""
from __future__ import annotations

import dataclasses
import threading
from typing import Optional

from llm_serving.config import LoRAConfig
from llm_serving.lora.peft import AdapterSpec, read_adapter
from llm_serving.lora.request import LoRARequest


class LoRARegistry:
    def __init__(self, config: LoRAConfig, hf):
        self.config, self.hf = config, hf
        self._lock = threading.Lock()          # the event loop and the engine thread read it
        self._specs: dict[tuple[int, str], AdapterSpec] = {}
        self._paths: dict[int, str] = {}       # id -> the path its requests run with
        self.served: dict[str, LoRARequest] = {}    # by name: --lora-modules, loaded ones
        # ids whose adapter a WorkAgent could not read: their requests ran without it, so KV
        # cached under the id may be the base model's; the id is never run again
        self._unreadable: dict[int, str] = {}
        self._next_id = 1
        for name, path, base in config.modules:
            self.load(name, path, base)

    def check(self, lora: LoRARequest) -> AdapterSpec:
        """The request's adapter, read and checked (once per id and path); a ValueError
        naming what is wrong. One id stands for one adapter: a second path under an id in
        use is refused, as its KV blocks in the prefix cache were computed with the first."""
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request: expected a LoRARequest, got "
                             f"{type(lora).__name__}")
        key = (lora.lora_int_id, lora.lora_path)
        self.check_readable(lora)
        with self._lock:
            spec = self._specs.get(key)
            if spec is not None:
                return spec
            known = self._paths.get(lora.lora_int_id)
        if known is not None and known != lora.lora_path:
            raise ValueError(f"lora_request: lora_int_id {lora.lora_int_id} is adapter "
                             f"{known!r} already; give {lora.lora_path!r} its own id")
        spec = read_adapter(lora.lora_path, self.hf, self.config.max_lora_rank)
        with self._lock:
            self._specs[key] = spec
            self._paths.setdefault(lora.lora_int_id, lora.lora_path)
            self._next_id = max(self._next_id, lora.lora_int_id + 1)
        return spec

    def load(self, name: str, path: str, base_model_name: Optional[str] = None,
             replace: bool = False) -> LoRARequest:
        """Serve the adapter at ``path`` as model ``name`` under a new id (also when it
        ``replace``s the adapter served under that name: KV cached with the old one is never
        taken for the new); ValueError if the name is taken or the adapter is bad."""
        with self._lock:
            if name in self.served and not replace:
                raise ValueError(f"lora_name: the adapter {name!r} has already been loaded "
                                 "(set load_inplace to true to replace it)")
            lora_id = self._next_id
            self._next_id += 1
        lora = LoRARequest(name, lora_id, path, base_model_name)
        self.check(lora)
        with self._lock:
            self.served[name] = lora
        return lora

    def check_readable(self, lora: LoRARequest) -> None:
        """A ValueError if a WorkAgent could not read this adapter id before."""
        why = self._unreadable.get(lora.lora_int_id)
        if why is not None:
            raise ValueError(f"lora_request: the model process could not read LoRA adapter "
                             f"{lora.lora_name!r} (lora_int_id {lora.lora_int_id}) at "
                             f"{lora.lora_path}: {why}; give it a new lora_int_id")

    def unreadable(self, lora_id: int, why: str) -> None:
        """A WorkAgent could not read adapter ``lora_id`` (its directory removed or changed
        since it was checked): the id is not run again, and a name served with it is served
        under a new id, checked again by its next request (a 400 while it is still bad)."""
        with self._lock:
            self._unreadable[lora_id] = why
            for key in [k for k in self._specs if k[0] == lora_id]:
                del self._specs[key]
            for name, lora in list(self.served.items()):
                if lora.lora_int_id == lora_id:
                    self.served[name] = dataclasses.replace(lora, lora_int_id=self._next_id)
                    self._next_id += 1

    def unload(self, name: str) -> Optional[LoRARequest]:
        """Stop serving model ``name``; its requests in flight run on."""
        with self._lock:
            return self.served.pop(name, None)

    def find(self, name: Optional[str]) -> Optional[LoRARequest]:
        with self._lock:
            return self.served.get(name) if name is not None else None
