"""Retention: removing what nothing needs any more (docs/operations.md, "Retention").

`rules` states what is still needed, as plain functions; `_sweep` is the
one sweep both owners run over their bucket (the artifact-store over the
artifacts, the recorder over the datasets), periodically and for
`lorafleet gc`.
"""
