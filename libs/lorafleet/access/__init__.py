"""Who may do what on the bus.

- identities: nkey identities, their store and the server's authorization;
- permissions: each identity's publish and subscribe permissions;
- passwords: the same with password users (`lorafleet nats-config`).

The names below are imported on first use, so that importing one module
here does not import the others (nats and access import each other's modules).
"""

from __future__ import annotations

from lorafleet._lazy import lazy_exports

_HOME = {
    "Identity": "identities",
    "IdentityError": "identities",
    "IdentityStore": "identities",
    "PermissionsError": "permissions",
    "agent_permissions": "permissions",
    "allows": "permissions",
}

__all__ = sorted(_HOME)

__getattr__ = lazy_exports(__name__, _HOME)
