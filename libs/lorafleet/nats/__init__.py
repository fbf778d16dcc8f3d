"""NATS: servers, clusters, configs, and lorafleet's own plumbing on nats-py."""
