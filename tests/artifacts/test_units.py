"""What a download writes: every kind has its file ending, and a checkpoint is
no result (downloaded only when asked for)."""

from __future__ import annotations

from lorafleet.artifacts import RESULTS, SUFFIXES, download_name
from lorafleet_schemas.messages import ArtifactKind


def test_every_kind_has_a_file_ending() -> None:
    assert set(SUFFIXES) == set(ArtifactKind)
    assert download_name("j1", ArtifactKind.PEFT) == "j1-peft.tar.gz"
    assert download_name("j1", ArtifactKind.CHECKPOINT) == "j1-checkpoint.tar"


def test_a_checkpoint_is_not_a_result() -> None:
    assert ArtifactKind.CHECKPOINT not in RESULTS
    assert set(RESULTS) == set(ArtifactKind) - {ArtifactKind.CHECKPOINT}
