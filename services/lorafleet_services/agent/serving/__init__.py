"""Serving adapters on the node's engines."""
