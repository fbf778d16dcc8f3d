"""The whole flow over TLS, with certificates made on the spot: the server
speaks TLS only and verifies clients' certificates; every process checks the
server by the test's CA and logs in with its own nkey."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from lorafleet.errors import ConnectError
from lorafleet.nats import _bus as bus
from lorafleet_schemas.messages import JobState
from tests.permissions.conftest import IdentityFleet, start_identity_fleet
from tests.permissions.flow import identity_system


@pytest.fixture
async def tls_fleet(tmp_path: Path) -> AsyncIterator[IdentityFleet]:
    fleet = await start_identity_fleet(tmp_path, tls=True)
    try:
        yield fleet
    finally:
        await fleet.server.stop()


async def test_a_job_ends_done_over_tls(
    tls_fleet: IdentityFleet, tmp_path: Path, sqlite_url: str
) -> None:
    assert tls_fleet.url.startswith("tls://")
    async with identity_system(tls_fleet, tmp_path, sqlite_url) as system:
        job, out = await system.run_job(tmp_path)
        assert job.state is JobState.DONE, job
        assert out.stat().st_size > 0
        assert system.refusals() == {}, system.refusals()


async def test_tls_mistakes_are_connect_errors_that_say_what_to_set(
    tls_fleet: IdentityFleet, tmp_path: Path
) -> None:
    # 5 s: a loaded suite took over 1 s to fail a handshake, which then read
    # as "no server answered" instead of the TLS refusal this test expects.
    good = tls_fleet.settings_for("client", "cli").with_(connect_timeout_s=5.0)
    nc = await bus.connect(good, "good")
    await bus.drain_quietly(nc)
    assert tls_fleet.certs is not None
    # The server's certificate checked against the system's CAs: unknown issuer.
    without_ca = good.with_(nats_tls_ca=None)
    with pytest.raises(ConnectError, match=r"TLS handshake .* failed \(CERTIFICATE_VERIFY_FAILED"):
        await bus.connect(without_ca, "no-ca")
    # A certificate file that is not there.
    missing = good.with_(nats_tls_ca=str(tmp_path / "nope.pem"))
    with pytest.raises(ConnectError, match=r"LORAFLEET_NATS_TLS_CA=.*nope.pem: cannot read"):
        await bus.connect(missing, "missing")
    # A plain nats:// URL to this TLS-only server, no client certificate.
    plain = good.with_(
        nats_url=tls_fleet.url.replace("tls://", "nats://"), nats_tls_cert=None, nats_tls_key=None
    )
    with pytest.raises(ConnectError, match=r"CERTIFICATE_REQUIRED.*LORAFLEET_NATS_TLS_CERT"):
        await bus.connect(plain, "plain")
