"""The nemesis's traffic through the gateway and to the engines, beside the jobs.

Four loops while the faults run, each with its own Random(f"{seed}/gw-...")
and each writing what it saw to the history (bench/nemesis_check.py reads it):

- uploads (`upload`): a file of 50-400 KB of {"q", "a"} records, its name
  `<project>-<n>.jsonl` (the checker tells its owner by it), sent slowly
  (16 KiB pieces, 50 ms apart: a gateway killed mid-upload meets one) to a
  random replica with a random key; most are then trained on (`job.submitted`
  with `via` "gateway", `gw.job`: the `ftjob-` id, its project), the job's
  metadata naming its project;
- chats (`chat`): the base or a succeeded fine-tuned model of the key's
  project, half of them streamed (some "slowly": a stream in flight for a
  few seconds), each with the text the engine gave: the stand-in answers
  "<the engine's name for the model> says: ...", so the text names the
  adapter that answered;
- tenancy (`tenancy.list`, `tenancy.get`): a key lists its files and jobs,
  and asks for one file and one job of the other project by id;
- serving changes (`serving.change`): a succeeded gateway job unserved, or
  served on another node (api.adapters.unserve / serve);
- the engines (`engines`): each engine's adapters (`/v1/models`), once a
  second, from this host (an engine behind a cut link reads as null).

`in_flight` on the fleet counts the uploads and streams on each replica,
for the mid-request kills (bench/nemesis_faults.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx2
from bench.nemesis_faults import History
from bench.nemesis_stack import Fleet

#: Seconds between uploads (a uniform pick), and the bytes of one.
UPLOAD_GAP_S = (2.0, 5.0)
UPLOAD_BYTES = (50_000, 400_000)
#: Bytes per piece of an upload's body, and seconds between pieces.
UPLOAD_PIECE_BYTES = 16_384
UPLOAD_PIECE_GAP_S = 0.05
#: Share of the uploads trained on, and the gateway jobs on their way at most.
TRAIN_SHARE = 0.7
MAX_GATEWAY_JOBS = 2
#: Steps of a gateway job (a uniform pick).
GATEWAY_STEPS = (10, 30)
#: Seconds between chats (a uniform pick); share of them with the base model, streamed, slow.
CHAT_GAP_S = (0.3, 1.2)
BASE_SHARE = 0.3
STREAM_SHARE = 0.5
SLOW_SHARE = 0.3
#: Seconds between tenancy probes and between serving changes (uniform picks).
TENANCY_GAP_S = (2.0, 4.0)
SERVING_GAP_S = (6.0, 12.0)
#: Seconds between engine samples, and one sample's wait for an engine.
ENGINE_SAMPLE_S = 1.0
ENGINE_TIMEOUT_S = 2.0
#: Seconds an HTTP request to the gateway may take (a slow engine, a stream).
HTTP_TIMEOUT_S = 30.0
#: Items a page of the gateway's listings holds at most (its MAX_PAGE), and
#: pages read of one listing at most (an hour's run uploads some 700 files).
PAGE_ITEMS = 100
MAX_PAGES = 100
#: The suffix of every gateway job's fine-tuned model.
SUFFIX = "nem"


class GatewayTraffic:
    def __init__(self, fleet: Fleet, history: History, seed: int, run: Any) -> None:
        self.fleet = fleet
        self.history = history
        self.seed = seed
        self.run = run  # bench/nemesis.py's Run: its jobs' states, its client
        self.keys = list(fleet.keys)
        #: ftjob id -> (project, lorafleet job id)
        self.jobs: dict[str, tuple[str, str]] = {}
        #: project -> file ids answered
        self.files: dict[str, list[str]] = {p: [] for _, p in fleet.keys.values()}
        self.counts = {"uploads": 0, "uploads_ok": 0, "chats": 0, "chats_ok": 0,
                       "gateway_jobs": 0, "serving_changes": 0}  # fmt: skip
        self.http = httpx2.AsyncClient(timeout=HTTP_TIMEOUT_S)

    async def close(self) -> None:
        await self.http.aclose()

    def _project(self, key: str) -> str:
        return self.fleet.keys[key][1]

    def _auth(self, key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {key}"}

    def _replica(self, rng: random.Random) -> tuple[str, str]:
        name = rng.choice(sorted(self.fleet.gateway_urls))
        return name, self.fleet.gateway_urls[name]

    @contextlib.contextmanager
    def _counting(self, replica: str, what: str) -> Any:
        key = f"{replica} {what}"
        self.fleet.in_flight[key] = self.fleet.in_flight.get(key, 0) + 1
        try:
            yield
        finally:
            self.fleet.in_flight[key] -= 1

    async def run_until(self, until: float) -> None:
        await asyncio.gather(
            self._uploads(until), self._chats(until), self._tenancy(until),
            self._serving(until),
        )  # fmt: skip

    # --- uploads and the jobs trained on them ---------------------------

    async def _uploads(self, until: float) -> None:
        rng = random.Random(f"{self.seed}/gw-uploads")
        n = 0
        while time.monotonic() < until:
            await asyncio.sleep(rng.uniform(*UPLOAD_GAP_S))
            n += 1
            key = rng.choice(self.keys)
            project = self._project(key)
            data = _records(rng, rng.randint(*UPLOAD_BYTES))
            filename = f"{project}-{n}.jsonl"
            file_id = await self._upload(rng, key, filename, data)
            active = [j for j, (_, lf) in self.jobs.items() if lf in self.run.active()]
            if file_id and rng.random() < TRAIN_SHARE and len(active) < MAX_GATEWAY_JOBS:
                await self._train(rng, key, file_id)

    async def _upload(self, rng: random.Random, key: str, filename: str, data: bytes) -> str | None:
        replica, url = self._replica(rng)
        project = self._project(key)
        boundary = f"nemesis{rng.randrange(1 << 40):x}"
        disposition = "Content-Disposition: form-data; name="
        head = (f"--{boundary}\r\n{disposition}\"purpose\"\r\n\r\nfine-tune\r\n"
                f"--{boundary}\r\n{disposition}\"file\"; filename=\"{filename}\"\r\n"
                "Content-Type: application/jsonl\r\n\r\n").encode()  # fmt: skip
        tail = f"\r\n--{boundary}--\r\n".encode()

        async def body() -> AsyncIterator[bytes]:
            yield head
            for at in range(0, len(data), UPLOAD_PIECE_BYTES):
                yield data[at : at + UPLOAD_PIECE_BYTES]
                await asyncio.sleep(UPLOAD_PIECE_GAP_S)
            yield tail

        self.counts["uploads"] += 1
        entry: dict[str, Any] = {"key": self.fleet.keys[key][0], "project": project,
                                 "gateway": replica, "filename": filename, "bytes": len(data),
                                 "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip
        headers = {**self._auth(key), "content-type": f"multipart/form-data; boundary={boundary}"}
        with self._counting(replica, "upload"):
            try:
                reply = await self.http.post(f"{url}/v1/files", content=body(), headers=headers)
            except Exception as e:
                self.history.write("upload", **entry, status=None, error=repr(e)[:300])
                return None
        file_id = reply.json().get("id") if reply.status_code == 200 else None
        self.history.write("upload", **entry, status=reply.status_code, file=file_id,
                           error="" if file_id else reply.text[:300])  # fmt: skip
        if file_id:
            self.counts["uploads_ok"] += 1
            self.files[project].append(file_id)
        return file_id

    async def _train(self, rng: random.Random, key: str, file_id: str) -> None:
        replica, url = self._replica(rng)
        project = self._project(key)
        steps, attempts = rng.randint(*GATEWAY_STEPS), rng.choice([1, 3])
        body = {"model": "tiny", "training_file": file_id, "suffix": SUFFIX,
                "metadata": {"project": project},
                "lorafleet": {"max_steps": steps, "gpu_memory_mib": 1000,
                              "max_attempts": attempts}}  # fmt: skip
        try:
            reply = await self.http.post(f"{url}/v1/fine_tuning/jobs", json=body,
                                         headers=self._auth(key))  # fmt: skip
        except Exception as e:
            self.history.write("job.submit_failed", via="gateway", error=repr(e)[:300])
            return
        if reply.status_code != 200:
            self.history.write("job.submit_failed", via="gateway", gateway=replica,
                               status=reply.status_code, error=reply.text[:300])  # fmt: skip
            return
        got = reply.json()
        ftjob, job = got["id"], got["id"].removeprefix("ftjob-")
        self.jobs[ftjob] = (project, job)
        self.counts["gateway_jobs"] += 1
        self.history.write("gw.job", job=job, ftjob=ftjob, project=project, file=file_id)
        self.history.write("job.submitted", job=job, node=None, max_attempts=attempts,
                           steps=steps, cancel=False, dataset=True, via="gateway")  # fmt: skip
        self.run._saw(job, "queued", None, 0)

    # --- chats ------------------------------------------------------------

    def _succeeded(self, project: str) -> list[str]:
        return [
            lf for p, lf in self.jobs.values()
            if p == project and self.run.seen.get(lf, ("",))[0] == "done"
        ]  # fmt: skip

    async def _chats(self, until: float) -> None:
        rng = random.Random(f"{self.seed}/gw-chats")
        n = 0
        while time.monotonic() < until:
            await asyncio.sleep(rng.uniform(*CHAT_GAP_S))
            n += 1
            key = rng.choice(self.keys)
            done = self._succeeded(self._project(key))
            job = rng.choice(done) if done and rng.random() >= BASE_SHARE else None
            model = f"ft:tiny:{SUFFIX}:{job}" if job else "tiny"
            stream = rng.random() < STREAM_SHARE
            slow = stream and rng.random() < SLOW_SHARE
            words = f"{'answer slowly ' if slow else ''}chat number {n}"
            await self._chat(rng, key, model, job, stream, words)

    async def _chat(
        self, rng: random.Random, key: str, model: str, job: str | None, stream: bool, words: str
    ) -> None:
        replica, url = self._replica(rng)
        body = {"model": model, "stream": stream, "messages": [{"role": "user", "content": words}]}
        self.counts["chats"] += 1
        entry: dict[str, Any] = {"project": self._project(key), "gateway": replica, "model": model,
                                 "job": job, "stream": stream}  # fmt: skip
        text, status, whole, error = "", None, False, ""
        try:
            if stream:
                with self._counting(replica, "stream"):
                    async with self.http.stream("POST", f"{url}/v1/chat/completions", json=body,
                                                headers=self._auth(key)) as reply:  # fmt: skip
                        status = reply.status_code
                        if status == 200:
                            async for line in reply.aiter_lines():
                                if line == "data: [DONE]":
                                    whole = True
                                elif line.startswith("data: "):
                                    delta = json.loads(line[6:])["choices"][0].get("delta", {})
                                    text += delta.get("content") or ""
                        else:
                            error = (await reply.aread()).decode(errors="replace")[:300]
            else:
                reply = await self.http.post(f"{url}/v1/chat/completions", json=body,
                                             headers=self._auth(key))  # fmt: skip
                status = reply.status_code
                if status == 200:
                    text, whole = reply.json()["choices"][0]["message"]["content"], True
                else:
                    error = reply.text[:300]
        except Exception as e:
            error = repr(e)[:300]
        if whole:
            self.counts["chats_ok"] += 1
        self.history.write("chat", **entry, status=status, text=text, whole=whole, error=error)

    # --- tenancy ------------------------------------------------------------

    async def _tenancy(self, until: float) -> None:
        rng = random.Random(f"{self.seed}/gw-tenancy")
        while time.monotonic() < until:
            await asyncio.sleep(rng.uniform(*TENANCY_GAP_S))
            key = rng.choice(self.keys)
            with contextlib.suppress(Exception):  # a replica down: the next probe
                await self.probe_tenancy(rng, key, "tenancy.list")

    async def probe_tenancy(self, rng: random.Random, key: str, kind: str) -> None:
        """The key's listings, and one file and job of the other project asked by id."""
        _, url = self._replica(rng)
        project, auth = self._project(key), self._auth(key)
        files = await listed(self.http, url, "/v1/files", auth)
        jobs = await listed(self.http, url, "/v1/fine_tuning/jobs", auth)
        listed_jobs = [{"id": j["id"], "project": (j.get("metadata") or {}).get("project")}
                       for j in jobs]  # fmt: skip
        listed_files = [{"id": f["id"], "filename": f["filename"]} for f in files]
        self.history.write(kind, project=project, jobs=listed_jobs, files=listed_files)
        others = [(p, f) for p, ids in self.files.items() if p != project for f in ids]
        if others:
            owner, file_id = rng.choice(others)
            got = await self.http.get(f"{url}/v1/files/{file_id}", headers=auth)
            self.history.write("tenancy.get", project=project, owner=owner, what="file",
                               id=file_id, status=got.status_code)  # fmt: skip
        their_jobs = [(p, j) for j, (p, _) in self.jobs.items() if p != project]
        if their_jobs:
            owner, ftjob = rng.choice(their_jobs)
            got = await self.http.get(f"{url}/v1/fine_tuning/jobs/{ftjob}", headers=auth)
            self.history.write("tenancy.get", project=project, owner=owner, what="job",
                               id=ftjob, status=got.status_code)  # fmt: skip

    # --- serving changes -------------------------------------------------------

    async def _serving(self, until: float) -> None:
        rng = random.Random(f"{self.seed}/gw-serving")
        nodes = sorted(self.fleet.engines)
        while time.monotonic() < until:
            await asyncio.sleep(rng.uniform(*SERVING_GAP_S))
            done = sorted(lf for _, lf in self.jobs.values()
                          if self.run.seen.get(lf, ("",))[0] == "done")  # fmt: skip
            if not done:
                continue
            job = rng.choice(done)
            action = rng.choice(["unserve", "serve"])
            node = rng.choice(nodes) if action == "serve" else None
            self.counts["serving_changes"] += 1
            self.history.write("serving.change", job=job, action=action, node=node)
            try:
                if action == "unserve":
                    await asyncio.wait_for(self.run.client.unserve(job), HTTP_TIMEOUT_S)
                else:
                    await asyncio.wait_for(self.run.client.serve(job, node), HTTP_TIMEOUT_S)
            except Exception as e:
                self.history.write("serving.change_failed", job=job, action=action,
                                   error=repr(e)[:300])  # fmt: skip

    # --- the engines ------------------------------------------------------------

    async def engines_now(self) -> dict[str, list[str] | None]:
        async def one(url: str) -> list[str] | None:
            try:
                got = await self.http.get(f"{url}/v1/models", timeout=ENGINE_TIMEOUT_S)
                return sorted(m["id"] for m in got.json()["data"] if m.get("parent"))
            except Exception:
                return None

        nodes = sorted(self.fleet.engines)
        lists = await asyncio.gather(*(one(self.fleet.engines[n].url) for n in nodes))
        return dict(zip(nodes, lists, strict=True))

    async def sample_engines(self, stop: asyncio.Event) -> None:
        """Until `stop` (the settling included: an engine back late is watched)."""
        while not stop.is_set():
            self.history.write("engines", adapters=await self.engines_now())
            await asyncio.sleep(ENGINE_SAMPLE_S)

    # --- the end ------------------------------------------------------------------

    async def record_final(self) -> None:
        """Each key's files, each downloaded and hashed; its jobs; the engines."""
        rng = random.Random(f"{self.seed}/gw-final")
        for key in self.keys:
            project, auth = self._project(key), self._auth(key)
            _, url = self._replica(rng)
            try:
                await self.probe_tenancy(rng, key, "final.tenancy")
                files = await listed(self.http, url, "/v1/files", auth)
            except Exception as e:
                self.history.write("final.files", project=project, files=None, error=repr(e))
                continue
            out = []
            for f in files:
                try:
                    got = await self.http.get(f"{url}/v1/files/{f['id']}/content", headers=auth)
                    sha = (
                        hashlib.sha256(got.content).hexdigest() if got.status_code == 200 else None
                    )
                    why = "" if sha else f"{got.status_code} {got.text[:200]}"
                except Exception as e:
                    sha, why = None, repr(e)[:200]
                out.append({"id": f["id"], "filename": f["filename"], "bytes": f["bytes"],
                            "sha256": sha, "why": why})  # fmt: skip
            self.history.write("final.files", project=project, files=out)
        self.history.write("final.engines", adapters=await self.engines_now())


async def listed(
    http: httpx2.AsyncClient,
    url: str,
    path: str,
    auth: dict[str, str],
    page_items: int = PAGE_ITEMS,
) -> list[dict[str, Any]]:
    """Every item of one of the gateway's listings, page after page: the
    first page alone (100 items) left an hour's later uploads out of the
    final read, each then judged lost (seed 44)."""
    items: list[dict[str, Any]] = []
    params = {"limit": str(page_items)}
    for _ in range(MAX_PAGES):
        reply = await http.get(f"{url}{path}", headers=auth, params=params)
        reply.raise_for_status()
        page = reply.json()
        items += page["data"]
        if not page.get("has_more") or not page["data"]:
            return items
        params["after"] = page["data"][-1]["id"]
    raise RuntimeError(f"{url}{path} has over {MAX_PAGES} pages of {page_items}")


def _records(rng: random.Random, size: int) -> bytes:
    """NDJSON {"q", "a"} pairs of about `size` bytes, new each time."""
    salt = rng.randrange(1 << 30)
    lines, total, i = [], 0, 0
    while total < size:
        line = json.dumps({"q": f"what is {salt}+{i}?", "a": f"{salt + i} " + "y" * 200}) + "\n"
        lines.append(line)
        total += len(line)
        i += 1
    return "".join(lines).encode()
