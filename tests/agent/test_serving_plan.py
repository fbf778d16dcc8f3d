"""The serving agent's plain choices, without a bus or an engine: the desired
set on disk, which adapter is evicted, what an engine must load again, the
reports' sequence across restarts, and a finished job's serve order."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import msgspec
import pytest

from lorafleet.artifacts import file_sha256
from lorafleet.fleet_serving import served_adapter_name
from lorafleet_schemas.messages import (
    ArtifactKind,
    Engine,
    ModelRecord,
    StartRequest,
    TrainerParams,
)
from lorafleet_services.agent.config import AgentConfig, AgentConfigError
from lorafleet_services.agent.serving.orders import (
    lora_flag,
    matching_engines,
    order_from_job,
    place_gguf,
    read_model_type,
)
from lorafleet_services.agent.serving.plan import (
    DesiredAdapter,
    DesiredSet,
    DesiredSetError,
    ReloadBackoff,
    ReportSeq,
    eviction_choice,
    needs_reload,
    remove_stale_copies,
)
from lorafleet_services.agent.serving.running_engines import VllmServer
from lorafleet_services.agent.serving.vllm_adapters import AdapterToServe

ENGINE = "http://127.0.0.1:8000"


def entry(name: str, served_at: float = 0.0, path: str = "/srv/x") -> DesiredAdapter:
    return DesiredAdapter(
        job_id=name.split("-")[0], served_name=name, sha256="a" * 64, model="tiny",
        base_model="/m", probe_base="/m", path=path, served_at=served_at,
    )  # fmt: skip


def _crash(_fd: int) -> None:
    raise OSError("disk gone")


def test_the_desired_set_survives_a_restart_and_a_torn_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "served" / "desired.json"
    desired = DesiredSet.load(path)
    assert desired.engines == {}
    desired.add(ENGINE, entry("j1-aaaa", 1.0))
    desired.add(ENGINE, entry("j2-bbbb", 2.0))
    desired.add("http://other:8000", entry("j1-aaaa", 3.0))
    again = DesiredSet.load(path)
    assert [a.served_name for a in again.on(ENGINE)] == ["j1-aaaa", "j2-bbbb"]
    assert [url for url, _ in again.of_job("j1")] == [ENGINE, "http://other:8000"]
    assert again.of_job("j1", "http://other:8000")[0][1].served_at == 3.0

    # An agent killed mid-write leaves its temporary file: the set is the old one.
    (path.parent / ".desired.json.tmp").write_text('{"engines": {"http://half')
    assert DesiredSet.load(path).on(ENGINE) == again.on(ENGINE)
    before = path.read_bytes()
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", _crash)
        with pytest.raises(OSError, match="disk gone"):
            again.add(ENGINE, entry("j3-cccc"))
    assert path.read_bytes() == before

    assert again.remove(ENGINE, "j1-aaaa") is not None
    assert again.remove(ENGINE, "j1-aaaa") is None
    assert [a.served_name for a in DesiredSet.load(path).on(ENGINE)] == ["j2-bbbb"]
    assert again.paths_in_use() == {"/srv/x"}


def test_a_damaged_desired_set_says_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "desired.json"
    path.write_text("not json")
    with pytest.raises(DesiredSetError, match="move it away and serve the adapters again"):
        DesiredSet.load(path)


def test_eviction_takes_the_least_recently_served_of_the_agents_own() -> None:
    desired = [entry("old-1", 10.0), entry("new-2", 20.0)]
    # A free slot, or the incoming one already loaded: nothing goes.
    assert eviction_choice(desired, ["old-1"], 2, "in-3") is None
    assert eviction_choice(desired, ["old-1", "new-2"], 2, "new-2") is None
    assert eviction_choice(desired, ["old-1", "new-2"], None, "in-3") is None
    # Full: the oldest of the agent's own goes, never one loaded by hand.
    assert eviction_choice(desired, ["old-1", "new-2"], 2, "in-3") == "old-1"
    assert eviction_choice(desired, ["by-hand", "new-2"], 2, "in-3") == "new-2"
    assert eviction_choice(desired, ["by-hand", "manual"], 2, "in-3") is None
    # One the control plane placed is never taken (it may be the last replica).
    placed = [msgspec.structs.replace(desired[0], placed=True), desired[1]]
    assert eviction_choice(placed, ["old-1", "new-2"], 2, "in-3") == "new-2"
    assert eviction_choice(placed[:1], ["old-1", "by-hand"], 2, "in-3") is None


def test_what_an_engine_must_load_again() -> None:
    desired = [entry("a-1"), entry("b-2")]
    assert needs_reload(desired, ["a-1", "b-2"], 100, 100) == []
    assert [a.served_name for a in needs_reload(desired, ["a-1"], 100, 100)] == ["b-2"]
    # A new process lost everything loaded at runtime, whatever a stale read listed.
    assert needs_reload(desired, ["a-1", "b-2"], 100, 200) == desired
    # First sight of the engine (no pid before): what it lacks.
    assert needs_reload(desired, [], None, 300) == desired


def test_report_seq_grows_across_restarts() -> None:
    clock = [1_000_000]
    seq = ReportSeq(lambda: clock[0])
    first = [seq.next() for _ in range(3)]
    assert first == [1_000_000, 1_000_001, 1_000_002]  # faster than the clock: +1 each
    clock[0] += 5  # the agent restarts a moment later, its counter gone
    restarted = ReportSeq(lambda: clock[0])
    assert restarted.next() > first[-1]
    assert ReportSeq().next() > 1_700_000_000 * 10**6  # the wall clock in microseconds


def test_stale_copies_go_and_held_ones_stay(tmp_path: Path) -> None:
    served = tmp_path / "served"
    (served / "held").mkdir(parents=True)
    (served / "stale").mkdir()
    (served / "desired.json").write_text("{}")
    assert remove_stale_copies(served, {str(served / "held")}) == ["stale"]
    assert sorted(p.name for p in served.iterdir()) == ["desired.json", "held"]
    assert remove_stale_copies(tmp_path / "none", set()) == []


def model(engine: Engine = Engine.VLLM, local_dir: str | None = "/models/tiny") -> ModelRecord:
    return ModelRecord(
        name="tiny", engine=engine, hf_repo="org/tiny", hf_revision="main", local_dir=local_dir,
        description="", created_at=dt.datetime.now(dt.UTC),
    )  # fmt: skip


def test_matching_engines_by_model_and_url() -> None:
    a = VllmServer(url="http://127.0.0.1:8000", model="/models/tiny")
    b = VllmServer(url="http://127.0.0.1:8001", model="org/tiny")
    c = VllmServer(url="http://127.0.0.1:8002", model="/models/other")
    assert matching_engines([a, b, c], model()) == [a]
    assert matching_engines([a, b, c], model(local_dir=None)) == [b]
    assert matching_engines([a, b, c], model(), engine=b.url) == []


def start_request(engine: Engine, serve: bool | None = None) -> StartRequest:
    return StartRequest(
        job_id="j1", attempt=1, model=model(engine), gpu_memory_mib=0, dataset="d",
        dataset_sha256="0" * 64, params=TrainerParams(), artifacts=[], serve=serve,
    )  # fmt: skip


def adapter_dir(tmp_path: Path) -> Path:
    d = tmp_path / "job" / "out" / "adapter"
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text('{"r": 4, "target_modules": ["q_proj"]}')
    (d / "adapter_model.safetensors").write_bytes(os.urandom(64))
    return d


def test_a_finished_jobs_adapter_is_staged_out_of_its_directory(tmp_path: Path) -> None:
    cfg = AgentConfig(node="n1", work_dir=tmp_path / "agent")
    src = adapter_dir(tmp_path)
    # No PEFT artifact delivered: packed for its sha256, the version's name.
    order = order_from_job(start_request(Engine.VLLM), cfg, src, Path("/b"), {}, {}, src.parent)
    assert order.sha256 == file_sha256(src.parent / "adapter.tar.gz")
    assert order.adapter_dir == cfg.served_dir / served_adapter_name("j1", order.sha256)
    assert (order.adapter_dir / "adapter_config.json").stat().st_mode & 0o004
    assert order.probe_base == "/b" and order.serve is None

    # llama.cpp without a GGUF: an order the serving agent refuses (no file kept).
    shas = {ArtifactKind.PEFT: "c" * 64}
    lc = order_from_job(start_request(Engine.LLAMACPP, True), cfg, src, Path("/b"), shas, {},
                        src.parent)  # fmt: skip
    assert (lc.gguf, lc.sha256) == (None, "c" * 64)
    gguf = tmp_path / "adapter.gguf"
    gguf.write_bytes(b"GGUF")
    shas[ArtifactKind.GGUF] = "d" * 64
    lc = order_from_job(start_request(Engine.LLAMACPP), cfg, src, Path("/b"), shas,
                        {ArtifactKind.GGUF: gguf}, src.parent)  # fmt: skip
    assert lc.sha256 == "d" * 64 and lc.gguf is not None and lc.gguf.read_bytes() == b"GGUF"


def test_the_gguf_goes_where_llama_server_reads_it(tmp_path: Path) -> None:
    gguf = tmp_path / "a.gguf"
    gguf.write_bytes(b"GGUF....")
    cfg = AgentConfig(node="n1", work_dir=tmp_path / "agent")
    assert cfg.llamacpp_adapters == tmp_path / "agent" / "llamacpp-adapters"
    placed = place_gguf(gguf, cfg.llamacpp_adapters, "j1-abc")
    assert placed == cfg.llamacpp_adapters / "j1-abc.gguf"
    assert placed.read_bytes() == b"GGUF...." and placed.stat().st_mode & 0o004
    assert lora_flag(placed) == f"--lora {placed}"
    assert [p.name for p in cfg.llamacpp_adapters.iterdir()] == ["j1-abc.gguf"]


def test_settings_for_serving(tmp_path: Path) -> None:
    cfg = AgentConfig.from_env(
        {"LORAFLEET_AGENT_ENGINES_REFRESH_S": "2.5", "LORAFLEET_AGENT_LLAMACPP_ADAPTERS_DIR": "/l"},
        node="n1",
    )
    assert (cfg.engines_refresh_s, cfg.llamacpp_adapters) == (2.5, Path("/l"))
    with pytest.raises(AgentConfigError, match=r"ENGINES_REFRESH_S must be 0\.1 \.\. 3600 s"):
        AgentConfig(node="n1", engines_refresh_s=0)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert read_model_type(str(tmp_path)) == "llama"
    assert read_model_type("org/tiny") is None


def test_full_module_paths_read_as_vllm_matches_them(tmp_path: Path) -> None:
    config = {"r": 4, "target_modules": ["model.layers.0.mlp.down_proj", "q_proj"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    adapter = AdapterToServe.read("j1", "a" * 64, tmp_path, "/m", "llama")
    assert adapter.target_modules == {"down_proj", "q_proj"}


def test_a_failing_reload_waits_longer_each_time_until_it_succeeds() -> None:
    now = [100.0]
    backoff = ReloadBackoff(1.0, 8.0, clock=lambda: now[0])
    key = (ENGINE, "job-1-aaaaaaaaaaaa")
    other = (ENGINE, "job-2-bbbbbbbbbbbb")
    assert backoff.due(key)
    assert [backoff.failed(key) for _ in range(5)] == [1.0, 2.0, 4.0, 8.0, 8.0]
    assert not backoff.due(key)
    assert backoff.due(other)  # one adapter's failures hold back no other
    now[0] += 7.9
    assert not backoff.due(key)
    now[0] += 0.1
    assert backoff.due(key)
    backoff.succeeded(key)
    assert backoff.due(key)
    assert backoff.failed(key) == 1.0  # a success starts the doubling again
