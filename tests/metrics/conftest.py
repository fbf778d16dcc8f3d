"""The metrics tests run the system tests' stack (real processes on a real
nats-server and PostgreSQL) with every process serving /metrics."""

from tests.system.conftest import stack  # noqa: F401  (the fixture, reused)
