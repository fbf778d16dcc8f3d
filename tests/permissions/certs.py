"""Certificates made on the spot with `openssl`: a CA, a server certificate for
127.0.0.1/localhost, and a client certificate, all signed by that CA."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: Days the certificates are valid (a test's lifetime is minutes).
VALID_DAYS = 2


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _signed(dir_: Path, name: str, subject: str, ext: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject,
             cwd=dir_)  # fmt: skip
    (dir_ / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", str(VALID_DAYS),
             "-extfile", f"{name}.ext", cwd=dir_)  # fmt: skip


def make_certs(dir_: Path) -> Certs:
    """A CA and two certificates it signed, under `dir_` (made)."""
    if shutil.which("openssl") is None:
        raise RuntimeError("the TLS tests need openssl: apt-get install openssl (./dev does)")
    dir_.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", "ca.key", "-out", "ca.pem", "-days", str(VALID_DAYS),
             "-subj", "/CN=lorafleet test CA", cwd=dir_)  # fmt: skip
    _signed(dir_, "server", "/CN=localhost",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")  # fmt: skip
    _signed(dir_, "client", "/CN=lorafleet client", "extendedKeyUsage=clientAuth\n")
    return Certs(
        dir_ / "ca.pem",
        dir_ / "server.pem",
        dir_ / "server.key",
        dir_ / "client.pem",
        dir_ / "client.key",
    )
