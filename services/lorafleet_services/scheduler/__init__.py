"""The scheduler: dispatch, node loss, reconcile, cancel, leadership."""
