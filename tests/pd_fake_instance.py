"""A small real HTTP server that speaks the PD contract's side of a prefill or a decode
instance, without a model, for the proxy's routing tests (tests/test_pd_proxy_routing.py).

    python tests/pd_fake_instance.py --port N --name NAME [--health 200]

Every request is recorded (route, body, and whether the client left before the answer
ended) and listed at ``GET /_log``. What it answers depends on the prompt text:
``status:NNN`` answers that status with a fixed body; ``slow`` waits 0.4 s per stream chunk
(and 3 s before a non-streamed answer); ``linger`` keeps a stream open 1 s after its last
event; a producer request (do_remote_decode) answers
``kv_transfer_params`` naming this instance. Answers are odd-looking on purpose (extra
spaces, a custom header) so that a byte-for-byte relay can be told from a re-encoding.
"""
from __future__ import annotations

import argparse
import asyncio
import json

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

app = FastAPI()
LOG: list = []
STATE = {"health": 200, "name": "?"}


def _prompt(path: str, body: dict) -> str:
    if "messages" in body:
        return " ".join(str(m.get("content")) for m in body["messages"])
    return str(body.get("inputs") if path.startswith("/models/") else body.get("prompt"))


def _kv(path: str, body: dict):
    if path.startswith("/models/"):
        return (body.get("parameters") or {}).get("kv_transfer_params")
    return body.get("kv_transfer_params")


@app.get("/health")
async def health():
    return Response(status_code=STATE["health"])


@app.get("/ready")
async def ready():
    """As an instance's: what the proxy routes by (the same code as /health here)."""
    return Response(status_code=STATE["health"])


@app.post("/_health/{code}")
async def set_health(code: int):
    STATE["health"] = code
    return {}


@app.get("/_log")
async def log():
    return LOG


@app.get("/v1/models")
async def models():
    return Response(b'{"object":  "list", "data": [{"id": "fake"}]}',
                    media_type="application/json", headers={"x-fake": STATE["name"]})


async def _generate(request: Request):
    path = request.url.path
    body = await request.json()
    entry = {"path": path, "body": body, "disconnected": False, "done": False}
    LOG.append(entry)
    prompt = _prompt(path, body)
    if "status:" in prompt:
        code = int(prompt.split("status:")[1][:3])
        return Response(b'{"error":  {"message": "refused by ' + STATE["name"].encode()
                        + b'", "param": "prompt"}}', status_code=code,
                        media_type="application/json", headers={"x-fake": STATE["name"]})
    slow = "slow" in prompt
    kv = _kv(path, body) or {}
    stream = path.endswith("generate_stream") or (not path.endswith("/generate")
                                                  and body.get("stream"))
    if kv.get("do_remote_decode"):
        answer = {"text": "p", "kv_transfer_params": {"do_remote_prefill": True,
                                                      "remote_block_ids": [7],
                                                      "from": STATE["name"]}}
    else:
        answer = {"text": f"answer of {STATE['name']}", "got_kv": kv}
    if not stream:
        for _ in range(30 if slow else 0):
            await asyncio.sleep(0.1)
            if await request.is_disconnected():
                entry["disconnected"] = True
                return Response(status_code=499)
        entry["done"] = True
        return Response(json.dumps(answer, indent=1).encode(), media_type="application/json",
                        headers={"x-fake": STATE["name"]})

    async def chunks():
        try:
            for i in range(5):
                if slow:
                    await asyncio.sleep(0.4)
                yield f"data:  {json.dumps({'i': i, 'from': STATE['name']})}\n\n".encode()
            yield b"data: [DONE]\n\n"
            entry["done"] = True
            if "linger" in prompt:      # the connection ends a moment after the last event
                await asyncio.sleep(1.0)
        finally:
            if not entry["done"]:
                entry["disconnected"] = True
    return StreamingResponse(chunks(), media_type="text/event-stream",
                             headers={"x-fake": STATE["name"]})


for route in ("/v1/completions", "/v1/chat/completions", "/models/{model}",
              "/models/{model}/generate", "/models/{model}/generate_stream"):
    app.add_api_route(route, _generate, methods=["POST"])


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--health", type=int, default=200)
    a = ap.parse_args()
    STATE.update(name=a.name, health=a.health)
    print("fake ready", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning")
