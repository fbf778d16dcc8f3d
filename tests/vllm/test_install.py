"""The CPU vLLM's install: the lock file's promises, and a cached install
taken as it is, by two installers at once, without a line of output."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from packaging.requirements import Requirement

from lorafleet_services.agent.node.installed_engines import newest_vllm_python, vllm_versions
from lorafleet_services.local import vllm_cpu


def test_the_lock_pins_every_package_with_a_hash() -> None:
    entries = " ".join(vllm_cpu.LOCK_FILE.read_text().split("\\\n")).splitlines()
    pins = [line for line in entries if line[:1].isalnum()]
    names = set()
    for line in pins:
        requirement, *hashes = line.split(" --hash=")
        spec = list(Requirement(requirement).specifier)
        assert len(spec) == 1 and spec[0].operator == "==", line
        assert hashes and all(h.strip().startswith("sha256:") for h in hashes), line
        names.add(Requirement(requirement).name.lower())
    assert {"vllm-cpu", "torch", "transformers"} <= names
    # Built for another torch: importing them fails ("operator torchvision::nms does not exist").
    assert not names & {"torchvision", "torchaudio", "torchcodec"}


def test_a_cached_install_is_found_and_taken_as_it_is() -> None:
    engines = vllm_cpu.engines_cache()
    if not vllm_cpu.installed(engines):
        pytest.fail(f"no vLLM in {engines}: run `./dev test` or `python -m {vllm_cpu.__name__}`")
    said: list[str] = []
    with ThreadPoolExecutor(2) as pool:
        pythons = set(pool.map(lambda _: vllm_cpu.install_vllm_cpu(engines, said.append), [0, 1]))
    assert pythons == {vllm_cpu.vllm_cpu_python(engines)}
    assert said == []
    # The agent's discovery finds it as a node's vLLM.
    assert vllm_cpu.VLLM_CPU_VERSION in vllm_versions(engines)
    assert newest_vllm_python(engines) == vllm_cpu.vllm_cpu_python(engines)
    assert vllm_cpu.vllm_version(vllm_cpu.vllm_cpu_python(engines)) == vllm_cpu.VLLM_CPU_VERSION
