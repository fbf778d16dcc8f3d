"""The `lorafleet` command against a running system, as a user types it."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from pathlib import Path

from tests.system.conftest import DATA, Stack


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


async def test_the_command_line_drives_a_job_from_catalog_to_download(stack: Stack) -> None:
    await stack.agent("node-1", env={"LORAFLEET_STANDIN_STEPS": "4"})
    weights = stack.tmp_path / "models" / "tiny"
    weights.mkdir(parents=True)
    rc, out, err = await lorafleet(
        stack, "models", "add", "tiny", "--engine", "vllm", "--local-dir", str(weights)
    )
    assert rc == 0, err
    assert json.loads(out)["name"] == "tiny"
    rc, out, _ = await lorafleet(stack, "models", "list", "--json")
    assert [m["name"] for m in json.loads(out)] == ["tiny"]

    data = stack.tmp_path / "pairs.jsonl"
    data.write_text(DATA)
    rc, out, err = await lorafleet(
        stack, "submit", "--model", "tiny", "--gpu-mib", "100", "--data", str(data),
        "--node", "node-1", "--param", "rank=4", "--param", "lr_scheduler=linear", "--watch",
    )  # fmt: skip
    assert rc == 0, err
    job = json.loads(out)
    assert job["state"] == "done" and job["params"]["rank"] == 4
    assert "step 4/4" in err  # progress was shown while it ran

    rc, out, _ = await lorafleet(stack, "jobs", "list", "--json", "--state", "done")
    assert [j["id"] for j in json.loads(out)] == [job["id"]]
    rc, out, _ = await lorafleet(stack, "jobs", "curve", job["id"])
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
        stack, "submit", "--model", "nope", "--gpu-mib", "1", "--data", str(bad)
    )
    assert rc == 1
    assert "not_found" in err and "$.model" in err
    rc, _, err = await lorafleet(
        stack, "submit", "--model", "x", "--gpu-mib", "1", "--data", str(bad), "--param", "rank=0"
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
    assert proc.returncode == 2
    assert b"no NATS server answered at nats://127.0.0.1:9" in err
