"""The trainer's environment on a node."""
