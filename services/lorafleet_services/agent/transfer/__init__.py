"""Bytes between the node and the artifact-store."""
