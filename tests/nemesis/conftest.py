"""The nemesis's tests: the system tests' stack for the bugs it found
(test_found.py; the artifact-store's delivery machine on a bare
nats-server), the checker on hand-made histories, one seeded run."""

from tests.artifacts.conftest import nc, publisher  # noqa: F401 (fixtures)
from tests.system.conftest import stack, stack_settings  # noqa: F401 (fixtures)
