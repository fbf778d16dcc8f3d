"""`lorafleet gateway`: OpenAI's fine-tuning API, and inference routed to the
engines, over lorafleet's NATS API. See docs/fine-tune-and-serve.md."""
