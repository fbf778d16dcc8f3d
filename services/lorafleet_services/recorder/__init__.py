"""The recorder: lorafleet's system of record (jobs, catalog, loss curves).

db (engines, migrations) <- models (tables) <- store (transactions) <- api
(request handlers, status application) <- service (NATS glue).
"""
