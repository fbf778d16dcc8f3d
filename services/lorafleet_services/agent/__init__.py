"""The node agent: heartbeats, runs the trainer, converts, delivers artifacts."""
