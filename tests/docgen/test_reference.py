"""The reference pages' generated sections (docs/cli.md, docs/settings.md,
docs/metrics.md) say what the code does: each test fails when a page and the
code differ, or when the code holds what the generator cannot document."""

from __future__ import annotations

import dataclasses
import inspect
import re
import shutil
from pathlib import Path

import pytest
import typer

from lorafleet import metrics
from lorafleet_services.docgen import cli_page, generate, metrics_page, settings_page

ROOT = Path(__file__).resolve().parents[2]
CODE = ("libs", "services", "trainer")


def test_the_pages_are_fresh() -> None:
    assert generate.stale() == [], f"run {generate.COMMAND}"


def test_a_hand_edited_or_unmarked_page_is_stale(tmp_path: Path) -> None:
    for page in generate.SECTIONS:
        shutil.copy(generate.DOCS / page, tmp_path / page)
    assert generate.stale(tmp_path) == []
    cli = tmp_path / "cli.md"
    cli.write_text(cli.read_text().replace("At most this many jobs.", "At most these jobs."))
    settings = tmp_path / "settings.md"
    settings.write_text(settings.read_text().replace("<!-- end generated: settings -->", ""))
    (tmp_path / "metrics.md").unlink()
    assert generate.stale(tmp_path) == [cli, settings, tmp_path / "metrics.md"]
    with pytest.raises(generate.MarkerError, match="end generated: settings"):
        generate.render(settings.read_text(), generate.SECTIONS["settings.md"])


def test_a_command_is_documented_with_its_usage_options_and_defaults() -> None:
    app = typer.Typer()
    group = typer.Typer(help="A group.")
    app.add_typer(group, name="things")

    @app.command("start")
    def start(
        job: str = typer.Argument(..., metavar="JOB", help="The job."),
        every_s: float = typer.Option(30.0, "--every-s", min=0.1, help="How often; a <b>."),
        secret: bool = typer.Option(False, "--secret", hidden=True),
        json: bool = typer.Option(False, "--json", help="As JSON."),
    ) -> None:
        """Start JOB.

        Wrapped over
        two lines."""

    @group.command("list")
    def list_things(json: bool = typer.Option(False, "--json", help="As JSON.")) -> None:
        """Every thing."""

    @group.command("show")
    def show_thing(json: bool = typer.Option(False, "--json", help="As JSON.")) -> None:
        """One thing."""

    page = cli_page.commands(app)
    assert "### `lorafleet start JOB`\n\nStart JOB.\n\nWrapped over two lines." in page
    assert "- `--every-s <float range>`: How often; a \\<b>. `[default: 30.0; x>=0.1]`" in page
    assert "--secret" not in page
    # --json has one help in three commands: described once, named in each.
    assert page.count("As JSON.") == 1
    assert page.count(f"- {cli_page.SHARED_LINK}: `--json`") == 3
    assert "### `lorafleet things list`\n\nEvery thing." in page


def test_every_command_and_option_of_the_app_is_on_the_page() -> None:
    import typer.main
    from typer.core import TyperGroup

    text = (generate.DOCS / "cli.md").read_text()
    missing = []

    def walk(command: object, path: str) -> None:
        assert isinstance(command, typer.core.TyperCommand | TyperGroup)
        if command.hidden:
            return
        heading = f"### `{path}"
        section = text.split(heading, 1)[1].split("\n### ", 1)[0] if heading in text else ""
        if not section and not isinstance(command, TyperGroup):
            missing.append(path)
        for param in command.params:
            opts = [o for o in getattr(param, "opts", []) if o.startswith("--")]
            if opts and not getattr(param, "hidden", False) and f"`{opts[0]}" not in section:
                missing.append(f"{path} {opts[0]}")
        if isinstance(command, TyperGroup):
            for name, sub in command.commands.items():
                walk(sub, f"{path} {name}")

    from lorafleet_services.cli import app

    walk(typer.main.get_command(app), "lorafleet")
    assert not missing


def test_each_settings_field_says_what_it_does() -> None:
    @dataclasses.dataclass
    class Config:
        """Config.

        documented: from the docstring, over
            two lines.
        """

        #: From a comment.
        commented: float = 1.0
        documented: int = 2
        forgotten: str = ""

    with pytest.raises(settings_page.UndocumentedSettingError, match=r"Config\.forgotten"):
        settings_page._described_fields(Config)
    del Config.__dataclass_fields__["forgotten"]
    assert settings_page._described_fields(Config)[0][1] == "From a comment."
    assert settings_page._described_fields(Config)[1][1] == "from the docstring, over two lines."


def test_every_variable_the_code_reads_is_on_the_settings_page() -> None:
    page = (generate.DOCS / "settings.md").read_text()
    named = set()
    for root in CODE:
        for path in (ROOT / root).rglob("*.py"):
            named |= set(re.findall(r"[\"'](LORAFLEET_[A-Z0-9_]*[A-Z0-9])[\"']", path.read_text()))
    operators = {n for n in named if not settings_page.INTERNAL.match(n)}
    assert operators, "the scan found nothing: its pattern is wrong"
    assert sorted(n for n in operators if f"`{n}`" not in page) == []
    for name, reader, *_ in settings_page.OTHERS:
        assert name in inspect.getsource(reader), f"{name} is no longer read there"
    for name in settings_page.variables():
        assert f"`{name}`" in page


def test_a_live_gauge_no_service_exports_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    exporters = metrics_page.live_exporters()
    # Named as `metrics.LEADER` in the scheduler; imported by name in the agent.
    assert exporters[metrics.LEADER.name] == ["scheduler"]
    assert exporters[metrics.JOB_STEP.name] == ["agent"]
    orphan = metrics.LiveGauge("lorafleet_orphan", "Nobody's")
    monkeypatch.setattr(metrics, "LIVE_GAUGES", (*metrics.LIVE_GAUGES, orphan))
    with pytest.raises(metrics_page.UnexportedMetricError, match="lorafleet_orphan"):
        metrics_page.table_of_metrics()


def test_every_exported_metric_is_on_the_metrics_page() -> None:
    page = (generate.DOCS / "metrics.md").read_text()
    defined = [m for ms in (metrics._COMMON, *metrics.SERVICE_METRICS.values()) for m in ms]
    names = [s.name for m in defined for s in m.describe()] + [g.name for g in metrics.LIVE_GAUGES]
    assert len(names) == len(set(names))
    for name in names:
        assert re.search(rf"`{name}(_total)?[{{`]", page), name


def test_help_text_is_literal_in_markdown() -> None:
    from lorafleet_services.docgen._markdown import prose, table

    assert prose('"_INBOX_<node>" max_attempts, LORAFLEET_* `a_<b>*`') == (
        '"\\_INBOX\\_\\<node>" max_attempts, LORAFLEET\\_\\* `a_<b>*`'
    )
    assert table(("a",), [("`x|y`",)]).endswith("| `x\\|y` |")
