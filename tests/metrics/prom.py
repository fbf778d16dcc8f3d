"""A real Prometheus for tests: a generated scrape config, a free port, a
temporary data directory; stopped (terminate, wait, kill) at the end."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.eventually import eventually

#: Seconds between scrapes in the tests (the default is 15 s in production).
SCRAPE_INTERVAL_S = 0.5
#: Seconds Prometheus has to say it is ready.
READY_TIMEOUT_S = 30.0
#: Seconds between SIGTERM and SIGKILL at stop.
STOP_TIMEOUT_S = 10.0
#: Its log line once it listens, with the port it took for port 0.
_LISTENING = re.compile(r'msg="Listening on" address=\S+:(\d+)')


def scrape_config(targets: Mapping[str, str], interval_s: float = SCRAPE_INTERVAL_S) -> str:
    """One scrape job over `targets` ({service: "host:port"}), each target
    labelled with its `service`, as compose/prometheus.yml labels them."""
    interval = f"{int(interval_s * 1000)}ms"
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {
                "job_name": "lorafleet",
                "scrape_timeout": interval,
                "static_configs": [
                    {"targets": [addr], "labels": {"service": name}}
                    for name, addr in targets.items()
                ],
            }
        ],
    }
    return json.dumps(config, indent=2)  # JSON is YAML


class PrometheusError(AssertionError):
    """Prometheus answered a query with an error."""


class Prometheus:
    def __init__(
        self, data_dir: Path, targets: Mapping[str, str], interval_s: float = SCRAPE_INTERVAL_S
    ) -> None:
        self.data_dir = data_dir
        self.targets = dict(targets)
        self.interval_s = interval_s
        self.port = 0  # Prometheus takes a free one and logs it (`start`)
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Prometheus:
        binary = shutil.which("prometheus")
        assert binary, "prometheus is not installed: apt-get install prometheus (./dev does)"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "prometheus.yml"
        config.write_text(scrape_config(self.targets, self.interval_s))
        with (self.data_dir / "prometheus.log").open("wb") as log:
            self.proc = await asyncio.create_subprocess_exec(
                binary, f"--config.file={config}", f"--storage.tsdb.path={self.data_dir / 'tsdb'}",
                "--web.listen-address=127.0.0.1:0",
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        logged = await eventually(
            self._logged_port,
            "prometheus to say where it listens",
            until=lambda port: port is not None,
            timeout_s=READY_TIMEOUT_S,
            interval_s=0.1,
        )
        assert logged is not None  # what `until` accepted
        self.port = logged
        await eventually(
            lambda: self._get("/-/ready"),
            "prometheus to be ready",
            timeout_s=READY_TIMEOUT_S,
            interval_s=0.2,
            retry_on=(OSError,),
        )
        return self

    def _logged_port(self) -> int | None:
        found = _LISTENING.search((self.data_dir / "prometheus.log").read_text(errors="replace"))
        return int(found[1]) if found else None

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.terminate()
        try:
            await asyncio.wait_for(self.proc.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()

    async def __aenter__(self) -> Prometheus:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _get(self, path: str, **params: Any) -> bytes:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""

        def get() -> bytes:
            with urllib.request.urlopen(self.url + path + query, timeout=10) as r:
                return bytes(r.read())

        return await asyncio.to_thread(get)

    async def api(self, path: str, **params: Any) -> Any:
        try:
            body = json.loads(await self._get(f"/api/v1/{path}", **params))
        except urllib.error.HTTPError as e:
            raise PrometheusError(f"{path} {params}: {e.read().decode()}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body}")
        return body["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector."""
        return list((await self.api("query", query=expr))["result"])

    async def value(self, expr: str) -> float | None:
        """The one value of an instant query (None: no series)."""
        result = await self.query(expr)
        assert len(result) <= 1, f"{expr}: {len(result)} series, expected one: {result}"
        return float(result[0]["value"][1]) if result else None

    async def query_range(
        self, expr: str, start: float, end: float, step_s: float
    ) -> list[dict[str, Any]]:
        data = await self.api("query_range", query=expr, start=start, end=end, step=step_s)
        return list(data["result"])

    async def scrapes(self) -> dict[str, int]:
        """{service: successful scrapes so far} (from `up` and its count)."""
        counts: dict[str, int] = {}
        for r in await self.query("sum by (service) (sum_over_time(up[1h]))"):
            counts[r["metric"]["service"]] = int(float(r["value"][1]))
        return counts

    async def wait_scrapes_after(self, moment: dict[str, int], more: int = 2) -> None:
        """Wait until every target was scraped `more` times since `moment`."""

        async def enough() -> bool:
            now = await self.scrapes()
            return all(now.get(s, 0) >= moment.get(s, 0) + more for s in self.targets)

        await eventually(enough, f"{more} more scrapes of every target", timeout_s=30)
