"""The artifact-store: chunked deliveries in, whole verified objects out."""
