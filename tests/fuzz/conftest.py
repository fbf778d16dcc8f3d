"""Hypothesis profiles for the fuzz tests, and one real stack for a module.

Profiles (LORAFLEET_FUZZ_PROFILE): "default" (random, with hypothesis's
example database under .hypothesis/) and "ci" (derandomized: the same
examples every run, no database), the default where CI is set. LORAFLEET_FUZZ_EXAMPLES sets
`max_examples` per test (default 12; each endpoint has a valid and an
invalid test, so about 340 requests in all).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

#: Examples per test unless LORAFLEET_FUZZ_EXAMPLES says otherwise.
DEFAULT_EXAMPLES = 12

settings.register_profile(
    "default",
    max_examples=int(os.environ.get("LORAFLEET_FUZZ_EXAMPLES", DEFAULT_EXAMPLES)),
    # Each example is a round trip to real services: timing is theirs.
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "ci", parent=settings.get_profile("default"), derandomize=True, database=None
)
settings.load_profile(
    os.environ.get("LORAFLEET_FUZZ_PROFILE", "ci" if os.environ.get("CI") else "default")
)
