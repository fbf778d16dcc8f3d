"""One data directory for every command: `lorafleet up --data-dir X` keeps its
NATS URL and the gateway's API keys in X, and the commands `up` tells its
user to type find them there — found when `up --data-dir X` printed a demo
data file `models add-demo` wrote elsewhere, and `auth api-key create`
wrote a key into a file the gateway never read. While `up --serve`'s
engine answers, `models add-demo` adds the model shaped for it."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx2
import msgspec

from lorafleet.exits import Exit
from lorafleet_services.demo import SERVED_MODEL
from lorafleet_services.demo_serve import announced
from tests.cli.conftest import ROOT, UP_TIMEOUT_S, cli_argv, up_env
from tests.eventually import eventually
from tests.gateway.engine import engine_argv

#: The CPU vLLM's attention takes head dimensions of 32 and up (tiny_model.VLLM_CPU_SIZES).
VLLM_MIN_HEAD_DIM = 32


async def test_the_commands_up_prints_use_its_data_dir_and_the_gateway_takes_the_key(
    tmp_path: Path,
) -> None:
    env = up_env(tmp_path)
    del env["LORAFLEET_DATA_DIR"]
    # The default data directory, in another terminal, is somewhere else.
    env["XDG_DATA_HOME"] = str(tmp_path / "default")
    data_dir = tmp_path / "elsewhere"
    proc = await asyncio.create_subprocess_exec(
        *cli_argv("up", "--data-dir", str(data_dir), "--nats-port", "0", "--no-agent"),
        cwd=ROOT, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    said: list[str] = []

    async def read(stderr: asyncio.StreamReader) -> None:
        while line := await stderr.readline():  # to the end: the children's lines come here
            said.append(line.decode(errors="replace"))

    reader = asyncio.create_task(read(proc.stderr))
    try:
        # The hints are printed once everything is up; `jobs show` is the last.
        await eventually(
            lambda: "lorafleet jobs show" in "".join(said), "up's hints", timeout_s=UP_TIMEOUT_S
        )
        text = "".join(said)
        exported = re.search(r"^\s*export LORAFLEET_DATA_DIR=(\S+)", text, re.M)
        assert exported, text
        assert Path(shlex.split(exported[1])[0]) == data_dir, exported[0]
        hinted_data = re.search(r"lorafleet submit .* --data (\S+)", text)
        gateway = re.search(r"OpenAI API: (\S+)/v1", text)
        assert hinted_data and gateway, text

        async def lorafleet(*args: str, **more_env: str) -> tuple[int, str, str]:
            run = await asyncio.create_subprocess_exec(
                *cli_argv(*args), cwd=ROOT, env={**env, **more_env},
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            out, err = await asyncio.wait_for(run.communicate(), 120)
            assert run.returncode is not None
            return run.returncode, out.decode(), err.decode()

        # As `up` says: the exported variable, then the commands as printed.
        rc, _, err = await lorafleet("models", "add-demo", LORAFLEET_DATA_DIR=str(data_dir))
        assert rc == 0, err
        assert Path(hinted_data[1]).is_file(), (hinted_data[1], err)
        rc, out, err = await lorafleet("models", "list", LORAFLEET_DATA_DIR=str(data_dir))
        assert rc == 0 and "tiny-llama" in out, (out, err)

        # Or the global option: the key lands where the gateway reads.
        rc, key, err = await lorafleet(
            "--data-dir", str(data_dir), "auth", "api-key", "create", "k"
        )
        assert rc == 0, err
        assert str(data_dir) in err, err
        async with httpx2.AsyncClient(timeout=30) as http:
            ok = await http.get(f"{gateway[1]}/v1/models", headers=_bearer(key.strip()))
            wrong = await http.get(f"{gateway[1]}/v1/models", headers=_bearer("lf-not-a-key"))
        assert ok.status_code == 200, ok.text
        assert wrong.status_code == 401, wrong.text

        await _add_demo_beside_an_engine(data_dir, lambda *a: lorafleet(*a))
    finally:
        if proc.returncode is None:
            proc.terminate()
        await asyncio.wait_for(proc.wait(), 60)
        await reader
    assert not (data_dir / "nats-url").exists()


async def _add_demo_beside_an_engine(
    data_dir: Path, lorafleet: Callable[..., Awaitable[tuple[int, str, str]]]
) -> None:
    """While `up --serve`'s engine is announced in the data directory (as
    demo_serve.demo_engine announces the CPU vLLM; here the stand-in engine,
    serving the same model directory), `models add-demo` adds the model shaped
    for it, for vLLM."""
    model_dir = data_dir / "models" / SERVED_MODEL
    engine = await asyncio.create_subprocess_exec(
        *engine_argv(str(model_dir), 0), cwd=ROOT, stdout=asyncio.subprocess.PIPE
    )  # port 0: it takes a free one and says which
    try:
        assert engine.stdout is not None
        url = (await asyncio.wait_for(engine.stdout.readline(), 30)).decode().split()[-1]
        with announced(data_dir, url):
            rc, out, err = await lorafleet(
                "--data-dir", str(data_dir), "models", "add-demo", "--json"
            )
        assert rc == 0, err
        added = msgspec.json.decode(out)
        assert (added["name"], added["engine"]) == (SERVED_MODEL, "vllm"), added
        assert added["local_dir"] == str(model_dir), added
        config = json.loads((model_dir / "config.json").read_text())
        assert config["hidden_size"] // config["num_attention_heads"] >= VLLM_MIN_HEAD_DIM, config
    finally:
        engine.terminate()
        await engine.wait()


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_up_serve_without_its_agent_is_refused_before_anything_starts(tmp_path: Path) -> None:
    env = up_env(tmp_path)
    run = subprocess.run(
        cli_argv("up", "--serve", "--no-agent"), cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == Exit.USAGE, run.stderr
    assert "drop --no-agent" in run.stderr, run.stderr
    assert not (tmp_path / "data" / "nats-url").exists()
