"""A small real OpenAI-compatible engine process, vLLM's interface in miniature.

Used where a real vLLM cannot yet be had (issue 22's CPU vLLM is not in
main yet): `python -m tests.gateway.engine [HOST [PORT]]` listens there
(default 127.0.0.1, a free port; `--host`/`--port` too) and prints
`listening http://HOST:PORT` on stdout. It serves
`GET /health`, `GET /v1/models` (its base and every adapter loaded, each with its
`parent`), `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
(vLLM's runtime LoRA loading: `lora_name`, `lora_path`), and `POST
/v1/chat/completions` and `/v1/completions`, whose answer names the model
that answered (`"<model> says: <last words>"`), streamed word by word as
server-sent events with `stream: true`. `GET /metrics` has vLLM's
`vllm:num_requests_running` (the requests it is answering) and
`vllm:num_requests_waiting` (0), and `vllm:request_success_total` (the
completions it began answering: a test tells which replica answered).

As a node's engine (`python -m tests.gateway.engine -m
vllm.entrypoints.openai.api_server --model BASE --port PORT ...`, see
`engine_argv`) it listens on PORT and serves BASE, and an agent's process
scan reads its command line as a vLLM server's. A loaded adapter's
`probe.json` (the stand-in trainer writes one) is what its greedy probe
completion answers, so the agent's load and confirm run as on vLLM.
`LORAFLEET_STANDIN_ENGINE_DELAY_S` delays every completion (a slow replica).
`LORAFLEET_STANDIN_ENGINE_CONTROL` names a JSON file read at each completion
and load, so a running engine can be turned slow or made to refuse loads
(the nemesis's engine faults): `{"delay_s": S}` delays each completion and
load by S seconds, `{"refuse_loads": true}` answers each load with vLLM's
400 for an adapter it could not load. No file: neither. With
`LORAFLEET_STANDIN_ENGINE_SAY_STARTED` set it also writes a
`service.started` JSON line on stderr once it listens (bench/nemesis_stack.py
runs it as a ServiceProcess, which reads stderr). It takes its port back
at once after a kill (SO_REUSEADDR).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

BASE = "tiny"
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: Seconds between two streamed chunks (a first token that comes late shows);
#: SLOW_GAP_S when the prompt says "slowly" (a buffering relay shows).
CHUNK_GAP_S = 0.005
SLOW_GAP_S = 0.4
#: ... and VERY_SLOW_GAP_S when it says "very slowly" (a request that stays
#: in flight while a test sends others).
VERY_SLOW_GAP_S = 2.0
models = [BASE]
#: adapter name -> its probe.json's adapter continuation (ids, logprobs).
probes: dict[str, dict[str, list[Any]]] = {}
#: Completions being answered now, and answered since the start.
running = [0]
answered = [0]
DELAY_S = float(os.environ.get("LORAFLEET_STANDIN_ENGINE_DELAY_S", "0"))
CONTROL = os.environ.get("LORAFLEET_STANDIN_ENGINE_CONTROL")


def control() -> dict[str, Any]:
    """The control file's settings now (none when it is absent or half written)."""
    if not CONTROL:
        return {}
    try:
        got = json.loads(Path(CONTROL).read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def engine_argv(base: str, port: int, max_loras: int = 4) -> list[str]:
    """The command line of an engine an agent's scan takes for vLLM's."""
    return [
        sys.executable, "-m", "tests.gateway.engine", "-m", API_SERVER_MODULE,
        "--model", base, "--port", str(port), "--enable-lora",
        "--max-loras", str(max_loras), "--max-cpu-loras", str(max_loras),
    ]  # fmt: skip


def answer_of(model: str, prompt: str) -> str:
    return f"{model} says: {' '.join(prompt.split()[-3:])}"


async def list_models(_: Request) -> Response:
    data = [
        {"id": m, "object": "model", "created": 0, "owned_by": "vllm",
         "parent": None if m == BASE else BASE}
        for m in models
    ]  # fmt: skip
    return JSONResponse({"object": "list", "data": data})


async def metrics(_: Request) -> Response:
    text = (
        f'vllm:num_requests_running{{model_name="{BASE}"}} {running[0]}\n'
        f'vllm:num_requests_waiting{{model_name="{BASE}"}} 0\n'
        f'vllm:request_success_total{{model_name="{BASE}"}} {answered[0]}\n'
    )
    return Response(text, media_type="text/plain")


async def load_adapter(request: Request) -> Response:
    body = await request.json()
    now = control()
    if now.get("delay_s"):
        await asyncio.sleep(float(now["delay_s"]))
    if now.get("refuse_loads"):
        message = f"Loading lora {body['lora_name']} failed: refused (its control file)"
        return JSONResponse({"error": {"message": message, "type": "BadRequestError",
                             "code": 400}}, status_code=400)  # fmt: skip
    probe = Path(body.get("lora_path", "")) / "probe.json"
    if probe.is_file():
        probes[body["lora_name"]] = json.loads(probe.read_text())["adapter"]
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
        running[0] += 1
        try:
            delay_s = DELAY_S + float(control().get("delay_s", 0))
            if delay_s:
                await asyncio.sleep(delay_s)
            return await answer(await request.json())
        finally:
            running[0] -= 1
            answered[0] += 1

    async def answer(body: dict[str, Any]) -> Response:
        model = body["model"]
        if model not in models:
            return JSONResponse(
                {"error": {"message": f"The model `{model}` does not exist.",
                           "type": "NotFoundError", "param": None, "code": 404}},
                status_code=404,
            )  # fmt: skip
        if kind == "text" and isinstance(body["prompt"], list) and model in probes:
            return JSONResponse(_probe_answer(probes[model], body["max_tokens"]))
        prompt = body["messages"][-1]["content"] if kind == "chat" else body["prompt"]
        text = answer_of(model, prompt)
        if body.get("stream"):
            gap_s = SLOW_GAP_S if "slowly" in prompt else CHUNK_GAP_S
            gap_s = VERY_SLOW_GAP_S if "very slowly" in prompt else gap_s
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


def _probe_answer(reference: dict[str, list[Any]], n: int) -> dict[str, Any]:
    """The greedy probe's answer, vLLM's shape (`return_tokens_as_token_ids`)."""
    tokens = [f"token_id:{i}" for i in reference["ids"][:n]]
    logprobs = {"tokens": tokens, "token_logprobs": reference["logprobs"][:n]}
    choice = {"index": 0, "text": "", "finish_reason": "length", "logprobs": logprobs}
    return {"id": "cmpl-probe", "object": "text_completion", "created": 0, "choices": [choice]}


app = Starlette(
    routes=[
        Route("/health", lambda _: Response()),
        Route("/metrics", metrics),
        Route("/v1/models", list_models),
        Route("/v1/load_lora_adapter", load_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_adapter, methods=["POST"]),
        Route("/v1/chat/completions", completion("chat"), methods=["POST"]),
        Route("/v1/completions", completion("text"), methods=["POST"]),
    ]
)


def _flag(name: str, default: str) -> str:
    argv = sys.argv[1:]
    return argv[argv.index(name) + 1] if name in argv else default


def main() -> None:
    global BASE
    BASE = _flag("--model", BASE)
    models[:] = [BASE]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY
    # A restarted engine takes its port back at once (a killed one leaves
    # its connections in TIME_WAIT on it).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    positional = list(itertools.takewhile(lambda a: not a.startswith("-"), sys.argv[1:]))
    host = _flag("--host", positional[0] if positional else "127.0.0.1")
    sock.bind((host, int(_flag("--port", positional[1] if len(positional) > 1 else "0"))))
    print(f"listening http://{host}:{sock.getsockname()[1]}", flush=True)
    if os.environ.get("LORAFLEET_STANDIN_ENGINE_SAY_STARTED"):  # a ServiceProcess reads stderr
        print(json.dumps({"event": "service.started", "url": f"http://{host}:{sock.getsockname()[1]}"}),
              file=sys.stderr, flush=True)  # fmt: skip
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
