"""The command an operator lives in, run for real: `lorafleet up` in one
terminal, `watch`, `top` and `jobs show` in others, against real jobs of the
stand-in trainer; and the same commands with pipes, as scripts run them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import struct
from collections.abc import Awaitable, Callable

from lorafleet.exits import Exit
from tests.cli.conftest import Up, queued_id
from tests.eventually import eventually

STEP = re.compile(r"step (\d+)/(\d+)")


def shown_step(screen: str) -> int:
    """The step the live display shows (its numbers line)."""
    steps = [
        int(m[1])
        for line in screen.splitlines()
        if "tok/s" in line
        for m in [STEP.search(line)]
        if m
    ]
    return steps[-1] if steps else -1


async def test_up_says_what_to_type_next_in_readable_log_lines(up: Up) -> None:
    screen = up.terminal.history(f"{up.terminal.session}:0")
    for hint in ("lorafleet models add", "lorafleet submit", "lorafleet watch", "lorafleet top"):
        assert hint in screen, screen
    assert str(up.data_dir) in screen
    # Console lines, one per event, the process named: not JSON.
    for service in ("recorder", "scheduler", "artifact-store", "agent"):
        assert re.search(rf"service\.started\s+\[{service}\]", screen), screen
    assert not [line for line in screen.splitlines() if line.lstrip().startswith("{")], screen


async def test_watch_redraws_one_display_in_place_and_top_lists_the_job(up: Up) -> None:
    job_id = await up.submit(300)
    t = up.terminal
    watch = t.new_window()
    t.type(watch, *up.argv("watch", job_id), then='; echo "exit""=$?"')
    first = await eventually(
        lambda: t.screen(watch), "the live display mid-run",
        until=lambda s: 0 < shown_step(s) < 250 and "ETA" in s, timeout_s=60, interval_s=0.1,
    )  # fmt: skip
    for part in ("━", "loss ", "1,000 tok/s", "ETA ", "peak ", "running"):
        assert part in first, first

    top = t.new_window()
    t.type(top, *up.argv("top", "--interval-s", "0.5"))
    await t.wait_for(top, job_id)
    fleet = await t.wait_for(top, "1,000")  # the trainer's tokens/s, from the events
    assert re.search(r"│ local\s+│ yes", fleet), fleet
    assert re.search(rf"│ {job_id}\s+│.*│ local\s+│ running", fleet), fleet
    assert "running (1)" in fleet, fleet
    t.keys(top, "C-c")

    later = await eventually(
        lambda: t.screen(watch), "the display to move on",
        until=lambda s: shown_step(s) > shown_step(first), timeout_s=30, interval_s=0.1,
    )  # fmt: skip
    # Redrawn in place: the same lines, a later step — not a line per step.
    assert len(later.rstrip().splitlines()) == len(first.rstrip().splitlines()), (first, later)
    end = await t.wait_for(watch, "exit=", timeout_s=60)
    assert "exit=0" in end and "final loss" in end and "step 300/300" in end, end
    history = t.history(watch)
    assert len([ln for ln in history.splitlines() if "tok/s" in ln]) == 1, history
    assert len(history.rstrip().splitlines()) < 40, history


async def test_submit_watch_on_a_terminal_ends_with_its_summary(up: Up) -> None:
    """The summary is the answer, on a terminal or not; the job's record
    (about 70 lines of JSON) is `jobs get --json`'s."""
    t = up.terminal
    window = t.new_window()
    t.type(window, *up.argv(*up.submit_args("--param", "max_steps=20", "--watch")),
           then='; echo "exit""=$?"')  # fmt: skip
    end = await t.wait_for(window, "exit=", timeout_s=60)
    history = t.history(window)
    assert "exit=0" in end and "final loss" in history, history
    assert not [ln for ln in history.splitlines() if ln.lstrip().startswith(("{", '"'))], history
    rc, out, err = await up.lorafleet(*up.submit_args("--param", "max_steps=20", "--watch"))
    assert rc == 0 and out == "" and "final loss" in err, (out, err)
    rc, out, err = await up.lorafleet("jobs", "get", queued_id(err), "--json")
    assert rc == 0 and json.loads(out)["state"] == "done", err


async def test_piped_watch_prints_a_line_per_tenth_never_per_step(up: Up) -> None:
    # Watched from the submit: a `watch` started after it can come in at the
    # last steps on a busy machine (a CLI start is seconds there, the job 2 s).
    rc, out, err = await up.submit_raw("--param", "max_steps=100", "--watch")
    assert rc == 0, err
    job_id = queued_id(err)
    progress = [ln for ln in err.splitlines() if STEP.search(ln) and "tok/s" in ln]
    assert 3 <= len(progress) <= 11, err
    assert "final loss" in err and "peft:" in err, err
    # --json streams the events: a finished job's watch is its one final event.
    rc, out, err = await up.lorafleet("watch", job_id, "--json")
    assert rc == 0, err
    [event] = [json.loads(line) for line in out.splitlines()]
    assert event["job"]["state"] == "done" and event["job"]["step"] == 100


async def test_jobs_show_draws_the_loss_curve_and_writes_a_png(up: Up) -> None:
    held = up.data_dir.parent / "held.jsonl"
    held.write_text('{"q": "a?", "a": "b"}\n{"q": "c?", "a": "d"}\n{"q": "e?", "a": "f"}\n')
    job_id = await up.submit(
        40, "--param", "epochs=4", "--eval-data", str(held), "--watch", "--plain"
    )
    rc, out, _ = await up.lorafleet("jobs", "curve", job_id, "--json")
    assert [p["step"] for p in json.loads(out)["evals"]] == [10, 20, 30, 40]
    png = up.data_dir.parent / "loss.png"
    rc, out, err = await up.lorafleet("jobs", "show", job_id, "--png", str(png))
    assert rc == 0, err
    assert job_id in out and "state changes" in out and "step 40/40" in out, out
    assert re.search(r"eval data +3 records, sha256/[0-9a-f]{64}", out), out
    assert re.search(r"[▀▄▚▞▖▗▘▝]{5}", out) and "eval loss" in out, out  # the curves, drawn
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", head
    width, height = struct.unpack(">II", head[16:24])
    assert (width, height) == (1000, 500)
    assert 10_000 < png.stat().st_size < 1_000_000


async def test_errors_say_what_to_do_in_one_line(up: Up) -> None:
    rc, _, err = await up.lorafleet("watch", "no-such-job")
    assert rc == Exit.REFUSED and _one_line(err) and "no job no-such-job" in err, err
    bad = up.data_dir.parent / "bad.jsonl"
    bad.write_text('{"q": "only a question"}\n')
    rc, _, err = await up.lorafleet(
        "submit", "--model", "tiny", "--gpu-memory-mib", "1", "--data", str(bad)
    )
    assert rc == Exit.REFUSED and _one_line(err) and "bad_request" in err, err
    rc, _, err = await up.lorafleet(
        "jobs", "list", env={"LORAFLEET_NATS_URL": "nats://127.0.0.1:9"}
    )
    assert rc == Exit.UNREACHABLE and _one_line(err) and "no NATS server answered" in err, err
    rc, _, err = await up.lorafleet("recorder", env={"LORAFLEET_LOG_FORMAT": "pretty"})
    assert rc == Exit.USAGE and _one_line(err) and "set it to json or console" in err, err


def _one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1 and "Traceback" not in err


async def test_a_cancelled_job_ends_the_watch_with_its_exit_code(up: Up) -> None:
    job_id = await up.submit(3000)
    watch = asyncio.create_task(up.lorafleet("watch", job_id, "--plain", timeout_s=60))
    try:
        await eventually(
            lambda: up.lorafleet("jobs", "get", job_id, "--json"), "the job to run",
            until=lambda r: json.loads(r[1])["state"] == "running", interval_s=0.2,
        )  # fmt: skip
        rc, _, err = await up.lorafleet("cancel", job_id, "--reason", "enough")
        assert rc == 0, err
        rc, _, err = await watch
    finally:
        watch.cancel()  # a no-op once it has ended; kills the command otherwise
        with contextlib.suppress(asyncio.CancelledError, AssertionError):
            await watch
    assert rc == Exit.JOB_CANCELLED and "cancelled" in err, err


async def test_resume_refuses_clearly_then_queues_from_the_checkpoint(up: Up) -> None:
    import nats

    rc, _, err = await up.lorafleet("resume", "no-such-job")
    assert rc == Exit.REFUSED and _one_line(err) and "no job no-such-job" in err, err
    job_id = await up.submit(3000)
    await eventually(
        lambda: up.lorafleet("jobs", "get", job_id, "--json"), "the job to run",
        until=lambda r: json.loads(r[1])["state"] == "running", interval_s=0.2,
    )  # fmt: skip
    rc, _, err = await up.lorafleet("resume", job_id)
    assert rc == Exit.REFUSED and _one_line(err) and "is running" in err, err
    rc, _, err = await up.lorafleet("cancel", job_id)
    assert rc == 0, err
    rc, _, err = await up.lorafleet("resume", job_id)
    assert rc == Exit.REFUSED and _one_line(err) and "no checkpoint stored" in err, err
    # The artifact-store's report of a checkpoint, as it sends it.
    nc = await nats.connect((up.data_dir / "nats-url").read_text().strip())
    try:
        body = {
            "id": job_id, "kind": "checkpoint", "size": 2048, "sha256": "c" * 64,
            "step": 7, "attempt": 1, "object": f"{job_id}/checkpoint",
        }  # fmt: skip
        await nc.request("lorafleet.store.jobs.artifact", json.dumps(body).encode(), timeout=10)
    finally:
        await nc.close()
    rc, out, err = await up.lorafleet("resume", job_id, "--attempts", "2", "--json")
    assert rc == 0, err
    resumed = json.loads(out)
    assert resumed["state"] == "queued" and resumed["max_attempts"] == 3, resumed
    assert "attempt 2 of 3 resumes from the checkpoint at step 7" in resumed["message"]
    rc, out, err = await up.lorafleet("jobs", "show", job_id)
    assert rc == 0 and "of 3" in out and "step 7 (attempt 1, 2.0 KiB)" in out, out
    rc, out, err = await up.submit_raw("--max-attempts", "2", "--resume-from", job_id, "--json")
    assert rc == 0, err
    second = json.loads(out)
    assert second["resume_from"] == job_id and second["max_attempts"] == 2, second
    for stop in (job_id, second["id"]):
        rc, _, err = await up.lorafleet("cancel", stop)
        assert rc == 0, err


async def test_drain_moves_training_only_when_asked_and_never_losing_steps_unasked(
    up: Up,
) -> None:
    rc, out, err = await up.lorafleet("nodes", "--json")
    assert rc == 0, err
    [node] = [n["heartbeat"]["node"] for n in json.loads(out)["nodes"]]
    job_id = await up.submit(3000)
    await eventually(
        lambda: up.lorafleet("jobs", "get", job_id, "--json"), "the job to train a step",
        until=lambda r: json.loads(r[1])["step"] >= 1, interval_s=0.2,
    )  # fmt: skip
    rc, _, err = await up.lorafleet("nodes", "drain", node, "--force")
    assert rc == Exit.REFUSED and _one_line(err) and "force only goes with" in err, err
    # No checkpoint: moved, it would lose its steps. Refused, nothing changed.
    rc, _, err = await up.lorafleet("nodes", "drain", node, "--move-training")
    assert rc == Exit.REFUSED and _one_line(err), err
    assert f"nothing changed: node {node} runs job {job_id}" in err and "--force" in err, err
    rc, out, err = await up.lorafleet("nodes", "--json")
    assert [n["schedule"] for n in json.loads(out)["nodes"]] == ["open"], out
    try:
        before = json.loads((await up.lorafleet("jobs", "get", job_id, "--json"))[1])["step"]
        rc, out, err = await up.lorafleet("nodes", "drain", node, "--move-training", "--force")
        assert rc == 0 and f"job {job_id} moves" in out and "drained" in out, (out, err)
        moved = await eventually(
            lambda: up.lorafleet("jobs", "get", job_id, "--json"), "the job queued again",
            until=lambda r: json.loads(r[1])["state"] == "queued", interval_s=0.2,
        )  # fmt: skip
        assert json.loads(moved[1])["max_attempts"] == 2, moved
        rc, out, err = await up.lorafleet("jobs", "curve", job_id, "--json")
        [event] = [
            e for e in json.loads(out)["events"] if e["to_state"] == "queued" and e["from_state"]
        ]
        message = event["message"]
        assert message.startswith(f"node {node} was drained with move_training"), event
        # Forced with no checkpoint, it has one taken at the move: no step before it is lost.
        said = re.search(r"attempt 2 of 2 resumes from the checkpoint at step (\d+)", message)
        assert said is not None and int(said[1]) >= before, (before, message)
    finally:
        # The only node is drained: the job waits (tests/system/test_drain.py has it
        # run elsewhere). Put back for the module's other tests whatever happened.
        for done in (("cancel", job_id), ("nodes", "uncordon", node)):
            rc, _, err = await up.lorafleet(*done)
            assert rc == 0, err


#: The codes of a command that could not do its work (the others say how a job ended).
ERRORS = {Exit.REFUSED, Exit.USAGE, Exit.UNREACHABLE, Exit.BAD_FILE}


async def test_each_exit_code_comes_from_the_real_command(up: Up) -> None:
    """Every code of the table (lorafleet/exits.py), each produced by the command
    against `up`'s nats-server, or against none; each error one line."""
    seen: dict[Exit, str] = {}

    async def expect(code: Exit, *args: str, env: dict[str, str] | None = None) -> str:
        rc, out, err = await up.lorafleet(*args, env=env)
        assert rc == code, (args, rc, out, err)
        assert code not in ERRORS or _one_line(err), (args, err)
        seen[code] = " ".join(args)
        return err

    await expect(Exit.OK, "jobs", "list")
    await expect(Exit.REFUSED, "jobs", "get", "no-such-job")
    err = await expect(Exit.USAGE, *up.submit_args("--param", "rank"))
    assert "--param 'rank': write it as key=value" in err, err
    rc, _, err = await up.lorafleet("submit", "--model", "tiny")  # Click's own: a box
    assert rc == Exit.USAGE and "Missing option '--data'" in err and "Traceback" not in err
    unreachable = {"LORAFLEET_NATS_URL": "nats://127.0.0.1:9"}
    await expect(Exit.UNREACHABLE, "jobs", "list", env=unreachable)
    database = f"sqlite+aiosqlite:///{up.data_dir.parent / 'alone.db'}"
    rc, _, err = await up.lorafleet(
        "recorder", env={**unreachable, "LORAFLEET_DATABASE_URL": database}
    )
    assert rc == Exit.UNREACHABLE and "no NATS server answered" in err, err
    await _bad_files(up, expect)

    done = await up.submit(5, "--no-serve", "--watch", "--plain")
    await expect(Exit.OK, "watch", done)
    err = await expect(Exit.NOT_SERVED, "watch", done, "--until-served")
    assert "serving: off for this job" in err, err
    # A node that never comes keeps a job queued, to end by hand.
    failed = await up.submit(5, "--node", "nowhere")
    await _transition(up, failed, "queued", "failed")
    await expect(Exit.JOB_FAILED, "watch", failed, "--plain")
    cancelled = await up.submit(5, "--node", "nowhere")
    await expect(Exit.OK, "cancel", cancelled)
    await expect(Exit.JOB_CANCELLED, "watch", cancelled, "--plain")
    waiting = await up.submit(5, "--node", "nowhere")
    seen[await _interrupted_watch(up, waiting)] = "watch, then Ctrl-C"
    await expect(Exit.OK, "cancel", waiting)
    assert set(seen) == set(Exit), {code: seen.get(code) for code in Exit}


async def _bad_files(up: Up, expect: Callable[..., Awaitable[str]]) -> None:
    """Each file a command reads or writes, given wrong: one line naming it, Exit.BAD_FILE."""
    tmp = up.data_dir.parent
    estimate = ("estimate", "--model", "tiny", "--params")
    err = await expect(Exit.BAD_FILE, *estimate, str(tmp / "missing.json"))
    assert "missing.json: no such file or directory" in err, err
    for text, says in (
        ("{rank: 8", "not JSON"),
        ("[8]", "holds a JSON list, not an object"),
        ('{"rnak": 8}', "unknown field `rnak`"),
    ):
        params = tmp / "params.json"
        params.write_text(text)
        err = await expect(Exit.BAD_FILE, *estimate, str(params))
        assert f"--params {params}: " in err and says in err, err
    err = await expect(Exit.BAD_FILE, *up.submit_args()[:-1], str(tmp))
    assert f"--data {tmp}: is a directory" in err, err
    err = await expect(Exit.BAD_FILE, *up.submit_args("--eval-data", str(tmp / "no.jsonl")))
    assert "--eval-data" in err and "no.jsonl: no such file" in err, err
    blocker = tmp / "a-file"
    blocker.write_text("")
    for command in (("auth", "--dir"), ("demo", "--out"), ("up", "--data-dir")):
        err = await expect(Exit.BAD_FILE, *command, str(blocker / "sub"))
        assert f"{command[-1]} {blocker / 'sub'}: not a directory" in err, err


async def _transition(up: Up, job_id: str, from_state: str, to_state: str) -> None:
    """The scheduler's compare-and-set, sent as it sends it."""
    import nats

    nc = await nats.connect((up.data_dir / "nats-url").read_text().strip())
    try:
        body = {"id": job_id, "from_state": from_state, "to_state": to_state, "message": "test"}
        await nc.request("lorafleet.store.jobs.transition", json.dumps(body).encode(), timeout=10)
    finally:
        await nc.close()


async def _interrupted_watch(up: Up, job_id: str) -> Exit:
    """Ctrl-C (SIGINT) in a `watch` that has begun: its exit code."""
    proc = await asyncio.create_subprocess_exec(
        *up.argv("watch", job_id, "--plain"), env=up.env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        line = await asyncio.wait_for(proc.stderr.readline(), 60)
        assert job_id in line.decode(), line
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        assert "stopped watching" in err.decode() and "Traceback" not in err.decode(), err
        assert proc.returncode is not None
        return Exit(proc.returncode)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_each_command_shows_a_view_and_with_json_prints_json(up: Up) -> None:
    """The one grammar of output: the same data for a person by default
    and as JSON with --json (a done job's, and the fleet's)."""
    job_id = await up.submit(5, "--no-serve", "--watch", "--plain")
    showing: dict[tuple[str, ...], str] = {
        ("jobs", "list"): job_id,
        ("jobs", "get", job_id): "attempt 1 of 1",
        ("jobs", "show", job_id): "state changes",
        ("jobs", "curve", job_id): "state changes",
        ("artifacts", job_id): "peft",
        ("models", "list"): "tiny",
        ("nodes",): "local",
        ("top",): "nodes (1)",
        ("adapters",): "adapters (0)",
    }
    for args, seen in showing.items():
        rc, view, err = await up.lorafleet(*args)
        assert rc == 0 and seen in view and not _is_json(view), (args, view, err)
        rc, out, err = await up.lorafleet(*args, "--json")
        assert rc == 0 and _is_json(out), (args, out, err)
    rc, out, _ = await up.lorafleet("top", "--json")
    assert [n["heartbeat"]["node"] for n in json.loads(out)["nodes"]] == ["local"]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


async def test_a_dpo_job_shows_its_margin_and_accuracy(up: Up) -> None:
    """`submit --method dpo` of preference pairs: the watch's lines and
    `jobs show` give the reward margin and the preference accuracy (the
    stand-in's), on the steps and on the held-out pairs."""
    pairs = up.data_dir.parent / "prefs.jsonl"
    pairs.write_text("".join(
        json.dumps({"prompt": f"{i}+{i}?", "chosen": str(2 * i), "rejected": str(2 * i + 1)})
        + "\n" for i in range(10)
    ))  # fmt: skip
    args = ("submit", "--model", "tiny", "--gpu-memory-mib", "1", "--data", str(pairs))
    rc, _, err = await up.lorafleet(*args, "--param", "max_steps=10")
    assert rc == Exit.REFUSED and "line 1" in err and "method is supervised" in err, err
    rc, out, err = await up.lorafleet(
        *args, "--method", "dpo", "--param", "max_steps=10", "--no-serve", "--watch", "--plain"
    )
    assert rc == 0, err
    job_id = queued_id(err)
    assert re.search(r"margin [0-9.]+ acc 100%", out + err), out + err
    rc, out, err = await up.lorafleet("jobs", "show", job_id)
    assert rc == 0, err
    assert re.search(r"eval preference +margin [0-9.]+ acc 100%", out), out
    assert "method=dpo" in out and "beta=0.1" in out, out
