"""The `lorafleet` command against a running system, as a user types it."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import os
import re
import sys
from pathlib import Path

import msgspec

from lorafleet.exits import Exit
from lorafleet_schemas.messages import Engine, JobRecord, JobState, ServingReport, ServingState
from lorafleet_services.agent.serving.plan import ReportSeq
from tests.system.conftest import DATA, Stack
from tests.vllm_server import free_port


async def lorafleet(stack: Stack, *args: str) -> tuple[int, str, str]:
    """Run `lorafleet ARGS` (this Python's) with the stack's settings; (rc, stdout, stderr)."""
    env = {**os.environ, **stack.settings.to_env(), "COLUMNS": "200"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lorafleet_services.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def queued_id(err: str) -> str:
    """The job id `lorafleet submit` says it queued, on stderr."""
    found = re.search(r"^queued job (\S+) \(", err, re.M)
    assert found, err
    return found[1]


async def test_the_command_line_drives_a_job_from_catalog_to_download(stack: Stack) -> None:
    await stack.agent("node-1", env={"LORAFLEET_STANDIN_STEPS": "4"})
    weights = stack.tmp_path / "models" / "tiny"
    weights.mkdir(parents=True)
    rc, out, err = await lorafleet(
        stack, "models", "add", "tiny", "--engine", "vllm", "--local-dir", str(weights), "--json"
    )
    assert rc == 0, err
    assert json.loads(out)["name"] == "tiny"
    rc, out, _ = await lorafleet(stack, "models", "list", "--json")
    assert [m["name"] for m in json.loads(out)] == ["tiny"]

    data = stack.tmp_path / "pairs.jsonl"
    data.write_text(DATA)
    rc, out, err = await lorafleet(
        stack, "submit", "--model", "tiny", "--gpu-memory-mib", "100", "--data", str(data),
        "--node", "node-1", "--param", "rank=4", "--param", "lr_scheduler=linear", "--watch",
    )  # fmt: skip
    assert rc == 0 and out == "", err  # the summary, on stderr, is the answer
    assert "step 4/4" in err  # progress was shown while it ran
    rc, out, err = await lorafleet(stack, "jobs", "get", queued_id(err), "--json")
    job = json.loads(out)
    assert job["state"] == "done" and job["params"]["rank"] == 4

    rc, out, _ = await lorafleet(stack, "jobs", "list", "--json", "--state", "done")
    assert [j["id"] for j in json.loads(out)] == [job["id"]]
    rc, out, _ = await lorafleet(stack, "jobs", "curve", job["id"], "--json")
    assert [p["step"] for p in json.loads(out)["points"]] == [1, 2, 3, 4]

    dest = stack.tmp_path / "dl"
    rc, _, err = await lorafleet(stack, "download", job["id"], "--out", str(dest))
    assert rc == 0, err
    [tgz] = list(dest.iterdir())
    digest = hashlib.sha256(tgz.read_bytes()).hexdigest()
    assert f"sha256 {digest} (checked)" in err.replace("\n", "")


async def test_the_command_line_says_what_to_change(stack: Stack) -> None:
    bad = stack.tmp_path / "bad.jsonl"
    bad.write_text('{"q": "only a question"}\n')
    rc, _, err = await lorafleet(
        stack, "submit", "--model", "nope", "--gpu-memory-mib", "1", "--data", str(bad)
    )
    assert rc == 1
    assert "not_found" in err and "$.model" in err
    rc, _, err = await lorafleet(
        stack,
        "submit",
        "--model",
        "x",
        "--gpu-memory-mib",
        "1",
        "--data",
        str(bad),
        "--param",
        "rank=0",
    )
    assert rc == 2 and "rank" in err
    rc, _, err = await lorafleet(stack, "jobs", "get", "no-such-job")
    assert rc == 1 and "not_found" in err


async def test_an_unreachable_server_is_a_clear_error(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "LORAFLEET_NATS_URL": "nats://127.0.0.1:9",
        "LORAFLEET_CONNECT_TIMEOUT_S": "1",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lorafleet_services.cli", "jobs", "list",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == Exit.UNREACHABLE
    assert b"no NATS server answered at nats://127.0.0.1:9" in err


async def test_watch_until_served_follows_the_adapter_to_its_engine(stack: Stack) -> None:
    """`watch --until-served`: a line per serving change after done, exit 0
    once an engine serves it, 3 when none does (refused, serving off)."""
    nobody = f"http://127.0.0.1:{free_port()}"  # never the machine's own vLLMs
    await stack.agent(
        "node-1", env={"LORAFLEET_STANDIN_STEPS": "2"}, vllm_servers=(nobody,),
        engines_refresh_s=0.5,
    )  # fmt: skip
    await stack.add_model()
    data = stack.tmp_path / "pairs.jsonl"
    data.write_text(DATA)

    async def submitted(*flags: str) -> JobRecord:
        rc, out, err = await lorafleet(
            stack, "submit", "--model", "tiny", "--gpu-memory-mib", "100", "--data", str(data),
            "--node", "node-1", *flags, "--json",
        )  # fmt: skip
        assert rc == 0, err
        return await stack.wait_state(json.loads(out)["id"], JobState.DONE)

    # serve: true and no engine for it on the node: refused, saying why.
    refused = await submitted("--serve")
    rc, _, err = await lorafleet(
        stack, "watch", refused.id, "--plain", "--until-served", "--serve-timeout-s", "60"
    )
    assert rc == Exit.NOT_SERVED, err
    text = err.replace("\n", "")
    assert "serving: refused on node-1 as" in text and "no vLLM on node-1 serves" in text, err
    # serve: false: said at once.
    off = await submitted("--no-serve")
    rc, _, err = await lorafleet(stack, "watch", off.id, "--plain", "--until-served")
    assert rc == Exit.NOT_SERVED and "serving: off for this job" in err, err
    # Nothing reported at all: the bound, and what to do.
    quiet = await submitted()
    rc, _, err = await lorafleet(
        stack, "watch", quiet.id, "--plain", "--until-served", "--serve-timeout-s", "2"
    )
    assert rc == Exit.NOT_SERVED and "nothing reported within 2 s" in err, err
    assert f"lorafleet serve {quiet.id}" in err.replace("\n", "")

    # Loading, then served (reports as an agent sends them): the watch
    # waits through loading and ends 0 on served, in JSON with --json.
    seqs = ReportSeq()

    async def report(state: ServingState) -> None:
        sent = ServingReport(
            job_id=quiet.id, node="node-1", engine="http://127.0.0.1:8000",
            engine_kind=Engine.VLLM, model="tiny", served_name=f"{quiet.id}-abcdef012345",
            sha256="a" * 64, state=state, seq=seqs.next(), time=dt.datetime.now(dt.UTC),
        )  # fmt: skip
        subject = stack.settings.names.serving_report("node-1", quiet.id)
        await stack.js.publish(subject, msgspec.json.encode(sent))

    await report(ServingState.LOADING)
    env = {**os.environ, **stack.settings.to_env(), "COLUMNS": "200"}
    watcher = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lorafleet_services.cli", "watch", quiet.id, "--json",
        "--until-served", "--serve-timeout-s", "60",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    assert watcher.stdout is not None
    lines: list[str] = []
    # The watch has shown loading before served is sent: a slow start of the
    # CLI must not let it see served first (a fixed sleep did, under load).
    while not any('"loading"' in line for line in lines):
        line = await asyncio.wait_for(watcher.stdout.readline(), 60)
        assert line, "the watch ended before it showed loading"
        lines.append(line.decode())
    assert watcher.returncode is None, "the watch must wait through loading"
    await report(ServingState.SERVED)
    out, err_bytes = await asyncio.wait_for(watcher.communicate(), 60)
    rc, out, err = watcher.returncode, "".join(lines) + out.decode(), err_bytes.decode()
    assert rc == 0, err
    servings = [e["serving"] for e in map(json.loads, out.splitlines()) if e["kind"] == "serving"]
    assert [s["state"] for s in servings] == ["loading", "served"]
