"""A small real OpenAI-compatible engine process, vLLM's interface in miniature.

Used where a real vLLM cannot yet be had (issue 22's CPU vLLM is not in
main yet): `python -m tests.gateway.engine` listens on a free port and
prints `listening http://127.0.0.1:PORT` on stdout. It serves
`GET /v1/models` (its base and every adapter loaded), `POST
/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's runtime LoRA
loading: `lora_name`, `lora_path`), and `POST /v1/chat/completions` and `/v1/completions`, whose
answer names the model that answered (`"<model> says: <last words>"`),
streamed word by word as server-sent events with `stream: true`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

BASE = "tiny"
#: Seconds between two streamed chunks (a first token that comes late shows);
#: SLOW_GAP_S when the prompt says "slowly" (a buffering relay shows).
CHUNK_GAP_S = 0.005
SLOW_GAP_S = 0.4
models = [BASE]


def answer_of(model: str, prompt: str) -> str:
    return f"{model} says: {' '.join(prompt.split()[-3:])}"


async def list_models(_: Request) -> Response:
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "vllm"} for m in models]
    return JSONResponse({"object": "list", "data": data})


async def load_adapter(request: Request) -> Response:
    body = await request.json()
    if body["lora_name"] not in models:
        models.append(body["lora_name"])
    return Response(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")


async def unload_adapter(request: Request) -> Response:
    body = await request.json()
    if body["lora_name"] not in models:
        return JSONResponse({"error": {"message": f"The lora adapter '{body['lora_name']}' "
                             "cannot be found.", "code": 404}}, status_code=404)  # fmt: skip
    models.remove(body["lora_name"])
    return Response(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")


def _chunks(kind: str, model: str, text: str, gap_s: float) -> AsyncIterator[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        for i, word in enumerate(text.split(" ")):
            piece = word if i == 0 else " " + word
            if kind == "chat":
                choice: dict[str, Any] = {"index": 0, "delta": {"content": piece}}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": piece}
                obj = "text_completion"
            chunk = {"id": "cmpl-1", "object": obj, "created": int(time.time()),
                     "model": model, "choices": [choice]}  # fmt: skip
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            await asyncio.sleep(gap_s)
        yield b"data: [DONE]\n\n"

    return gen()


def completion(kind: str) -> Any:
    async def handle(request: Request) -> Response:
        body = await request.json()
        model = body["model"]
        if model not in models:
            return JSONResponse(
                {"error": {"message": f"The model `{model}` does not exist.",
                           "type": "NotFoundError", "param": None, "code": 404}},
                status_code=404,
            )  # fmt: skip
        prompt = body["messages"][-1]["content"] if kind == "chat" else body["prompt"]
        text = answer_of(model, prompt)
        if body.get("stream"):
            gap_s = SLOW_GAP_S if "slowly" in prompt else CHUNK_GAP_S
            chunks = _chunks(kind, model, text, gap_s)
            return StreamingResponse(chunks, media_type="text/event-stream")
        if kind == "chat":
            message = {"role": "assistant", "content": text}
            choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "message": message}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "finish_reason": "stop", "text": text}
            obj = "text_completion"
        usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
        return JSONResponse({"id": "cmpl-1", "object": obj, "created": int(time.time()),
                             "model": model, "choices": [choice], "usage": usage})  # fmt: skip

    return handle


app = Starlette(
    routes=[
        Route("/v1/models", list_models),
        Route("/v1/load_lora_adapter", load_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_adapter, methods=["POST"]),
        Route("/v1/chat/completions", completion("chat"), methods=["POST"]),
        Route("/v1/completions", completion("text"), methods=["POST"]),
    ]
)


def main() -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY
    sock.bind(("127.0.0.1", 0))
    print(f"listening http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
