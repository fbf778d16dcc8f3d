"""The reference pages' tables, generated from the code they describe:
docs/cli.md from the Typer app, docs/settings.md from the settings classes,
docs/metrics.md from the metric definitions (generate.py writes and checks them)."""
