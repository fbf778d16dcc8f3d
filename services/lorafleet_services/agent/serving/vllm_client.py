"""An async client for one vLLM server's OpenAI-compatible API: the calls the
agent makes to serve adapters, nothing more.

`VllmClient(url, api_key=None)`: `models()`, `load_lora_adapter(name, path)`,
`unload_lora_adapter(name)`, `greedy_logprobs(model, token_ids, n)` (a
greedy completion's token ids and logprobs), `complete()`, `chat()`, `health()`. The API key goes as
`Authorization: Bearer <key>` when given. Every failure is a `VllmError`
naming the engine's URL: `VllmUnreachableError` (no answer: connection
refused, timeout) or `VllmRequestError` (the engine answered an error status,
with its message). Responses are decoded with msgspec into the wire shapes
below, tolerant of fields this client does not read.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import httpx2
import msgspec

#: One request's bound; a load reads the adapter from disk, a few seconds at most.
REQUEST_TIMEOUT_S = 30.0
#: The first request with an adapter after the engine's start took over 30 s
#: on the CPU build (later ones a tenth of a second): the probe's bound.
PROBE_REQUEST_TIMEOUT_S = 300.0


class VllmError(Exception):
    """A call to a vLLM server failed; `url` is the server's."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"vLLM at {url}: {message}")
        self.url = url


class VllmUnreachableError(VllmError):
    """The server did not answer (refused, reset, timed out)."""


class VllmRequestError(VllmError):
    """The server answered with an error status; `status` and `detail` are its."""

    def __init__(self, url: str, status: int, detail: str) -> None:
        super().__init__(url, f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


class ModelCard(msgspec.Struct):
    """One entry of `GET /v1/models`: a base model (parent None) or a LoRA
    adapter (parent: the base's served name; root: the adapter's path)."""

    id: str
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class _ModelList(msgspec.Struct):
    data: list[ModelCard]


class _Logprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]


class _Choice(msgspec.Struct):
    text: str
    logprobs: _Logprobs | None = None


class _Completion(msgspec.Struct):
    choices: list[_Choice]


class _ChatMessage(msgspec.Struct):
    content: str | None = None


class _ChatChoice(msgspec.Struct):
    message: _ChatMessage


class _ChatCompletion(msgspec.Struct):
    choices: list[_ChatChoice]


class VllmClient:
    """One server's API. Use as an async context manager, or `aclose()`."""

    def __init__(
        self, url: str, api_key: str | None = None, timeout_s: float = REQUEST_TIMEOUT_S
    ) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx2.AsyncClient(base_url=self.url, headers=headers, timeout=timeout_s)

    async def __aenter__(self) -> VllmClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def health(self) -> bool:
        """The server answers /health with 200 (it has finished starting)."""
        try:
            return (await self._http.get("/health")).status_code == 200
        except httpx2.TransportError:
            return False

    async def models(self) -> list[ModelCard]:
        """What the server serves: its base model(s) and the adapters loaded."""
        body = await self._call("GET", "/v1/models")
        return msgspec.json.decode(body, type=_ModelList).data

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load the adapter directory `path` (read by the server) as model `name`."""
        await self._call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def unload_lora_adapter(self, name: str) -> None:
        await self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name})

    async def greedy_logprobs(
        self, model: str, token_ids: list[int], max_tokens: int
    ) -> tuple[list[int], list[float]]:
        """`model`'s greedy continuation of the prompt `token_ids`: exactly
        `max_tokens` token ids (end of sequence ignored) and the log-probability
        of each. (Not the prompt's own logprobs: see lorafleet_trainer.probe.)"""
        request = {
            "model": model,
            "prompt": token_ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
        }
        body = await self._call("POST", "/v1/completions", request, PROBE_REQUEST_TIMEOUT_S)
        choice = msgspec.json.decode(body, type=_Completion).choices[0]
        if choice.logprobs is None:
            raise VllmError(self.url, "the completion came back without logprobs")
        ids = [int(t.rpartition(":")[2]) for t in choice.logprobs.tokens]
        values = [
            float(v) if v is not None else float("nan") for v in choice.logprobs.token_logprobs
        ]
        return ids, values

    async def complete(self, model: str, prompt: str, max_tokens: int = 16) -> str:
        """A greedy completion's text (the tests' requests in flight)."""
        request = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        body = await self._call("POST", "/v1/completions", request)
        return msgspec.json.decode(body, type=_Completion).choices[0].text

    async def chat(self, model: str, content: str, max_tokens: int = 24) -> str:
        """One greedy chat completion's reply to the user message `content` (the demo's)."""
        request = {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        body = await self._call("POST", "/v1/chat/completions", request)
        return msgspec.json.decode(body, type=_ChatCompletion).choices[0].message.content or ""

    async def _call(
        self,
        method: str,
        path: str,
        payload: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> bytes:
        bound = httpx2.USE_CLIENT_DEFAULT if timeout_s is None else httpx2.Timeout(timeout_s)
        try:
            response = await self._http.request(method, path, json=payload, timeout=bound)
        except httpx2.TransportError as exc:
            raise VllmUnreachableError(self.url, f"{method} {path}: {exc!r}") from exc
        if response.status_code >= 400:
            raise VllmRequestError(self.url, response.status_code, _detail(response))
        return response.content


def _detail(response: httpx2.Response) -> str:
    """The server's error message: {"error": {"message"}} (newer) or
    {"message"} (older), else the body's start."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        inner = body.get("error")
        if isinstance(inner, dict) and "message" in inner:
            return str(inner["message"])
        if "message" in body:
            return str(body["message"])
    return response.text[:500]
