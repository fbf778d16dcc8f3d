"""The nemesis's tests: the system tests' stack for the bugs it found
(test_found.py), the checker on hand-made histories, one seeded run."""

from tests.system.conftest import stack, stack_settings  # noqa: F401 (fixtures)
