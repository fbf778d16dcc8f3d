"""A training job on the node."""
