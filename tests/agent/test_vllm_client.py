"""The vLLM client against a small real HTTP server (not vLLM: the session's
vLLM runs without a key): the API key goes as a bearer token, and an error
body in either of vLLM's shapes becomes the VllmRequestError's detail."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from lorafleet_services.agent.serving.engine_watch import EngineView, EngineWatch
from lorafleet_services.agent.serving.running_engines import VllmServer
from lorafleet_services.agent.serving.vllm_client import VllmClient, VllmRequestError
from tests.vllm_server import free_port

ERRORS = {
    "/v1/load_lora_adapter": {"error": {"message": "rank 32 is over 16", "code": 400}},
    "/v1/unload_lora_adapter": {"object": "error", "message": "adapter x not found"},
}


class _Recorder(BaseHTTPRequestHandler):
    seen: ClassVar[list[str | None]] = []

    def do_GET(self) -> None:
        self._answer(200, {"data": [{"id": "base", "root": "/m"}, {"id": "a", "parent": "base"}]})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._answer(400, ERRORS[self.path])

    def _answer(self, status: int, body: object) -> None:
        type(self).seen.append(self.headers.get("Authorization"))
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass  # the test reads `seen`, not stderr


@pytest.fixture
def http_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def test_bearer_key_and_error_shapes(http_url: str) -> None:
    _Recorder.seen = []
    async with VllmClient(http_url, api_key="s3cret") as client:
        cards = await client.models()
        assert [(c.id, c.parent) for c in cards] == [("base", None), ("a", "base")]
        with pytest.raises(VllmRequestError, match="rank 32 is over 16") as new_shape:
            await client.load_lora_adapter("a", "/x")
        with pytest.raises(VllmRequestError, match="adapter x not found"):
            await client.unload_lora_adapter("x")
    assert new_shape.value.status == 400 and http_url in str(new_shape.value)
    assert _Recorder.seen == ["Bearer s3cret"] * 3
    async with VllmClient(http_url) as keyless:
        await keyless.models()
    assert _Recorder.seen[-1] is None


async def test_the_engine_watch_reads_a_configured_engine_with_its_key(http_url: str) -> None:
    _Recorder.seen = []
    watch = EngineWatch([f"{http_url}|s3cret"], refresh_s=5.0, node="n1")
    assert watch.refs() == []  # nothing read yet: the heartbeat carries nothing, waits for nothing
    await watch.refresh()
    assert _Recorder.seen == ["Bearer s3cret"]
    (ref,) = watch.refs()
    assert (ref.url, ref.adapters, ref.max_lora_rank) == (http_url, ["a"], None)

    gone = EngineWatch([f"http://127.0.0.1:{free_port()}"], refresh_s=5.0, node="n1")
    (view,) = await gone.refresh()
    assert not view.up and gone.refs()[0].adapters == []


def test_an_engine_that_stops_answering_keeps_in_the_beat_what_it_listed_last() -> None:
    """A busy engine's /v1/models timing out listed it empty in the beat, and
    the placement asked for every adapter it held; a new process lists nothing."""
    server = VllmServer(url="http://127.0.0.1:1", pid=7)
    listed = EngineView(server, ("a",))
    silent = EngineView(server, None).after(listed)
    assert not silent.up and (silent.ref().adapters, silent.ref().answered) == (["a"], False)
    assert EngineView(server, None).after(silent).ref().adapters == ["a"]  # silent again
    restarted = EngineView(replace(server, pid=8), None).after(listed)
    assert restarted.ref().adapters == [] and not restarted.ref().answered
    back = EngineView(server, ("b",)).after(silent).ref()
    assert (back.adapters, back.answered) == (["b"], True)
