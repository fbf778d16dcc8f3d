"""The embedded default's local agent (`lorafleet up`, `lorafleet demo`): its
config converts to GGUF out of the box without GitHub, and what the user set
in the environment wins over every default."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lorafleet_services.agent.config import DEFAULT_CONVERSION_SOURCE
from lorafleet_services.agent.environment.gguf_conversion import ConversionError
from lorafleet_services.cli import up_agent_config
from lorafleet_services.stack import LOCAL_NODE, local_agent_config

LOCAL_TAG = "b9999"


async def fake_local_source(directory: Path) -> tuple[str, str]:
    """What `local_conversion_source` returns, without fetching from PyPI."""
    return str(directory / "{tag}.tar.gz"), LOCAL_TAG


async def test_the_default_converts_with_the_local_source_as_the_demo_does(tmp_path: Path) -> None:
    config = await local_agent_config(tmp_path, env={}, prepare=fake_local_source)
    assert config.conversion_source == str(tmp_path / "llama.cpp-source" / "{tag}.tar.gz")
    assert config.conversion_source != DEFAULT_CONVERSION_SOURCE  # not GitHub
    assert config.llamacpp_tag == LOCAL_TAG
    assert config.node == LOCAL_NODE
    assert config.engines_dir == tmp_path / "engines"
    assert config.work_dir == tmp_path / "agent"
    assert config.allow_cpu is True
    assert config.python == sys.executable
    assert config.run_as == ""  # the user running `lorafleet up`


async def test_the_users_conversion_settings_win(tmp_path: Path) -> None:
    prepared: list[Path] = []

    async def must_not_prepare(directory: Path) -> tuple[str, str]:
        prepared.append(directory)
        return await fake_local_source(directory)

    env = {
        "LORAFLEET_AGENT_CONVERSION_SOURCE": "/mirror/llama.cpp-{tag}.tar.gz",
        "LORAFLEET_AGENT_LLAMACPP_TAG": "b1234",
    }
    config = await local_agent_config(tmp_path, env=env, prepare=must_not_prepare)
    assert config.conversion_source == "/mirror/llama.cpp-{tag}.tar.gz"
    assert config.llamacpp_tag == "b1234"
    assert prepared == []  # nothing fetched the user did not ask for


async def test_a_tag_alone_is_fetched_from_the_default_source(tmp_path: Path) -> None:
    # The local source holds one release only; a user naming another wants that one.
    env = {"LORAFLEET_AGENT_LLAMACPP_TAG": "b1234"}
    config = await local_agent_config(tmp_path, env=env, prepare=fake_local_source)
    assert config.llamacpp_tag == "b1234"
    assert config.conversion_source == DEFAULT_CONVERSION_SOURCE


async def test_every_agent_setting_of_the_user_wins_over_the_defaults(tmp_path: Path) -> None:
    env = {
        "LORAFLEET_AGENT_ENGINES_DIR": str(tmp_path / "my-engines"),
        "LORAFLEET_AGENT_WORK_DIR": str(tmp_path / "my-work"),
        "LORAFLEET_AGENT_ALLOW_CPU": "0",
        "LORAFLEET_AGENT_PYTHON": "/opt/py/bin/python3",
        "LORAFLEET_AGENT_RUN_AS": "someone",
        "LORAFLEET_AGENT_CANCEL_GRACE_S": "2.5",
    }
    config = await local_agent_config(tmp_path, "n-2", env=env, prepare=fake_local_source)
    assert config.node == "n-2"
    assert config.engines_dir == tmp_path / "my-engines"
    assert config.work_dir == tmp_path / "my-work"
    assert config.allow_cpu is False
    assert config.python == "/opt/py/bin/python3"
    assert config.run_as == "someone"
    assert config.cancel_grace_s == 2.5


async def test_without_local_preparation_the_default_source_stays(tmp_path: Path) -> None:
    config = await local_agent_config(tmp_path, env={}, prepare=None)
    assert config.conversion_source == DEFAULT_CONVERSION_SOURCE
    assert config.llamacpp_tag is None


async def test_up_still_starts_without_pypi_and_says_where_conversion_fetches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("LORAFLEET_AGENT_CONVERSION_SOURCE", "LORAFLEET_AGENT_LLAMACPP_TAG"):
        monkeypatch.delenv(key, raising=False)

    async def no_pypi(directory: Path) -> tuple[str, str]:
        raise ConversionError("fetching llama-cpp-python from PyPI with pip failed: offline")

    config = await up_agent_config(tmp_path, LOCAL_NODE, prepare=no_pypi)
    assert config.conversion_source == DEFAULT_CONVERSION_SOURCE
    said = " ".join(capsys.readouterr().err.split())
    assert "offline" in said and "LORAFLEET_AGENT_CONVERSION_SOURCE" in said
