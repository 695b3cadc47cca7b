"""The chaos benchmark's catalog driver: changes the catalog several times a second through the
public API (admin key), and afterwards judges each change against the streams that ran.

Changes (tenant acme's admin key, so runtime loads land in acme's namespace):
- `push`: `/v1/load_lora_adapter` with `load_inplace` on a loaded runtime name (a new version);
- `unload`: `/v1/unload_lora_adapter` (every version yanked);
- `republish`: an unloaded name loaded again from other files (a reused name, new weights);
- `yank` / `unyank`: `/v1/admin/adapters/NAME/{yank,unyank}` on public adapters;
- `reweight`: a composition's staged version (other gates) unyanked or yanked again through
  `/v1/admin/compositions/NAME/...`: its latest, i.e. the gates an unpinned request gets, changes.
  (The API has no endpoint that publishes a composition; its versions were published up front.)

After each change returns, the store is read directly (the truth, not a router's view) for the
name's live versions. `judge` then finds, per change: the first stream served with the new
version (seconds after the call returned), and every stream sent after the call returned (and
before the name's next change began) that was served a version not live-and-latest any more.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.chaos_streams import StreamResult

# The answer's header when some router did not confirm reloading before the call returned (the
# change is made; such a router converges within store.refresh_s).
UNCONFIRMED = "x-molora-catalog-unconfirmed"


@dataclass
class Change:
    kind: str
    name: str  # as acme names it
    t_call: float
    t_return: float = 0.0
    status: int | None = None
    latest: str | None = None  # the name's latest live version after the change (None: gone)
    body: str = ""
    request_id: str | None = None
    unconfirmed: str | None = None  # X-Molora-Catalog-Unconfirmed: routers that did not reload
    store_read: bool = False  # `latest` was read from the store after the call returned


@dataclass
class CatalogState:
    runtime: dict[str, bool]  # runtime name -> loaded
    public: list[str]  # public adapters the churn yanks and unyanks
    comps: dict[str, list[str]]  # composition -> staged versions (v2..)
    folders: list[str]
    busy: set[str] = field(default_factory=set)


class Churn:
    def __init__(
        self,
        url: str,
        admin_key: str,
        registry: Any,
        state: CatalogState,
        rate: float,
        seed: int,
        workers: int = 3,
    ) -> None:
        self.url, self.headers = url, {"Authorization": f"Bearer {admin_key}"}
        self.registry, self.state, self.rate = registry, state, rate
        self.rng = random.Random(seed)
        self.workers = workers
        self.changes: list[Change] = []
        self.paused = asyncio.Event()  # set: no changes (a fault that needs a quiet store)

    def _store_name(self, kind: str, name: str) -> str:
        return f"acme~{name}" if name in self.state.runtime else name

    def _latest(self, kind: str, name: str) -> str | None:
        infos = self.registry.versions(kind, self._store_name(kind, name))
        live = [v.version for v in infos if not v.yanked]
        return max(live, key=lambda v: int(v.lstrip("v")), default=None)

    def _pick(self) -> tuple[str, str, str, dict[str, Any]] | None:
        """(kind of change, name, path, body) for a name no change is running on."""
        s, rng = self.state, self.rng
        roll = rng.random()
        if roll < 0.45:
            free = [n for n in s.runtime if n not in s.busy]
            if not free:
                return None
            name = rng.choice(free)
            folder = rng.choice(s.folders)
            if not s.runtime[name]:
                body = {"lora_name": name, "lora_path": folder}
                return "republish", name, "/v1/load_lora_adapter", body
            if rng.random() < 0.25:
                return "unload", name, "/v1/unload_lora_adapter", {"lora_name": name}
            body = {"lora_name": name, "lora_path": folder, "load_inplace": True}
            return "push", name, "/v1/load_lora_adapter", body
        if roll < 0.75:
            free = [n for n in s.public if n not in s.busy]
            if not free:
                return None
            name = rng.choice(free)
            live = self._cached_live.get(name, True)
            action = "yank" if live else "unyank"
            body = {"reason": "chaos"} if live else {"version": "v1"}
            return action, name, f"/v1/admin/adapters/{name}/{action}", body
        free = [n for n in s.comps if n not in s.busy]
        if not free:
            return None
        name = rng.choice(free)
        version = rng.choice(s.comps[name])
        live = self._comp_live.setdefault(name, set())
        action = "yank" if version in live else "unyank"
        return "reweight", name, f"/v1/admin/compositions/{name}/{action}", {"version": version}

    async def _one(self, http: httpx.AsyncClient, pick: tuple[str, str, str, dict]) -> None:
        kind, name, path, body = pick
        self.state.busy.add(name)
        change = Change(kind, name, time.monotonic())
        try:
            try:
                resp = await http.post(path, json=body, headers=self.headers)
                change.status, change.body = resp.status_code, resp.text[:200]
                change.request_id = resp.headers.get("x-request-id")
                change.unconfirmed = resp.headers.get(UNCONFIRMED)
            except httpx.HTTPError as exc:
                change.body = repr(exc)[:200]
            change.t_return = time.monotonic()
            collection = "composition" if kind == "reweight" else "adapter"
            try:  # the truth after the call, whatever it answered
                change.latest = await asyncio.to_thread(self._latest, collection, name)
                change.store_read = True
            except Exception as exc:  # the store down: the state after the change is unknown
                change.body += f" (store read: {type(exc).__name__})"
            if kind in ("push", "republish", "unload"):
                self.state.runtime[name] = change.latest is not None or not change.store_read
            elif kind in ("yank", "unyank") and change.store_read:
                self._cached_live[name] = change.latest is not None
            elif kind == "reweight" and change.status == 200:
                live = self._comp_live.setdefault(name, set())
                live.symmetric_difference_update({body["version"]})
        finally:
            self.changes.append(change)
            self.state.busy.discard(name)

    async def run(self, stop: asyncio.Event) -> None:
        self._cached_live: dict[str, bool] = {}
        self._comp_live: dict[str, set[str]] = {}
        gap = 1.0 / self.rate
        running: set[asyncio.Task] = set()
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as http:
            next_at = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                next_at += gap
                if self.paused.is_set() or len(running) >= self.workers:
                    continue
                pick = self._pick()
                if pick is None:
                    continue
                task = asyncio.create_task(self._one(http, pick))
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.gather(*running, return_exceptions=True)


def _names_in(model: str) -> list[str]:
    return [t.rpartition(":")[0] if ":" in t else t for t in model.split("+")]


def judge(
    changes: list[Change],
    streams: list[StreamResult],
    duration_s: float,
    t0: float,
    first_fault: float = float("inf"),
) -> dict[str, Any]:
    """Per change: when it was first served, and any stream sent after it returned (and before
    the name's next change began) that got another state than the store held after it. Every
    change counts, whatever its call answered: the store read after it is the truth."""
    seq_all = sorted(changes, key=lambda c: c.t_call)
    by_name: dict[str, list[Change]] = {}
    for c in seq_all:
        by_name.setdefault(c.name, []).append(c)
    first_served: list[float] = []
    stale: list[dict[str, Any]] = []
    for name, seq in by_name.items():
        for i, c in enumerate(seq):
            if not c.store_read:
                continue
            until = seq[i + 1].t_call if i + 1 < len(seq) else float("inf")
            prefix = f"composition:{name}@" if c.kind == "reweight" else f"{name}@"
            want = f"{prefix}{c.latest}" if c.latest else None
            window = [
                s
                for s in streams
                if c.t_return < s.t_start < until
                and name in _names_in(s.model)
                and "@" not in s.model
            ]
            for s in window:
                got = next((v for v in s.versions or [] if v.startswith(prefix)), None)
                # Admission (the version pin) happens after the send, up to the first event:
                # a later change begun by then may be the one in force.
                admitted_by = s.t_start + (s.ttft if s.ttft is not None else s.t_end - s.t_start)
                allowed = {want} | {
                    f"{prefix}{later.latest}" if later.latest else None
                    for later in seq[i + 1 :]
                    if later.t_call < admitted_by and later.store_read
                }
                if (s.status == 200 and got not in allowed) or (
                    s.status == 404 and None not in allowed
                ):
                    stale.append(
                        {
                            "change": c.kind,
                            "name": name,
                            "change_status": c.status,
                            "want": want,
                            "got": got if s.status == 200 else "404",
                            "sent_after_return_s": round(s.t_start - c.t_return, 3),
                            "change_at_s": round(c.t_call - t0, 1),
                            "request_id": s.request_id,
                            "unconfirmed_header": c.unconfirmed,
                            "change_id": id(c),
                        }
                    )
            served = [
                s.t_start for s in window if s.status == 200 and want and want in (s.versions or [])
            ]
            if served and c.status == 200 and c.kind in ("push", "republish", "reweight", "unyank"):
                first_served.append(min(served) - c.t_return)
    ok = [c for c in changes if c.status == 200]
    # Per change answered 200: how long after its return a stream was still served the state
    # before it (0 when none was): the change's "in force after return" time.
    late: dict[int, float] = {}
    for x in stale:
        if x["change_status"] == 200:
            late[x["change_id"]] = max(late.get(x["change_id"], 0.0), x["sent_after_return_s"])
    in_force = sorted(late.get(id(c), 0.0) for c in ok)
    calls = [c.t_return - c.t_call for c in changes]
    early = [c.t_return - c.t_call for c in changes if c.t_return < first_fault]
    first_served.sort()
    kinds: dict[str, int] = {}
    for c in ok:
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    failed = [c for c in changes if c.status != 200]
    return {
        "changes_ok": len(ok),
        "changes_failed": len(failed),
        "changes_failed_examples": [
            f"at {c.t_call - t0:.1f} s {c.kind} {c.name}: {c.status} {c.body} "
            f"(x-request-id {c.request_id}; store after: {c.latest})"
            for c in failed[:8]
        ],
        "change_5xx": sum(1 for c in failed if (c.status or 0) >= 500),
        "changes_per_s": round(len(ok) / duration_s, 2) if duration_s else 0.0,
        "by_kind": kinds,
        "change_call_p50_s": round(_pct(sorted(calls), 0.5), 3),
        "change_call_p99_s": round(_pct(sorted(calls), 0.99), 3),
        "first_served_after_return_p50_s": round(_pct(first_served, 0.5), 3),
        "first_served_after_return_p99_s": round(_pct(first_served, 0.99), 3),
        "first_served_measured": len(first_served),
        "stale_after_return": len(stale),
        # the violations of the contract: the call answered 200 without naming unconfirmed
        # routers (a call that failed, or named some, promised nothing beyond store.refresh_s)
        "stale_after_confirmed_return": sum(
            1 for x in stale if x["change_status"] == 200 and not x["unconfirmed_header"]
        ),
        # any stale answer later than store.refresh_s (2 s) + 1 s: past every stated bound
        "stale_beyond_refresh_s": sum(1 for x in stale if x["sent_after_return_s"] > 3.0),
        "stale_examples": [{k: v for k, v in x.items() if k != "change_id"} for x in stale[:5]],
        "in_force_after_return_p99_s": round(_pct(in_force, 0.99), 3),
        "in_force_after_return_max_s": round(in_force[-1], 3) if in_force else 0.0,
        "changes_unconfirmed": sum(1 for c in changes if c.unconfirmed),
        "change_call_p50_before_faults_s": round(_pct(sorted(early), 0.5), 3),
        "changes_before_faults": len(early),
    }


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    return xs[min(len(xs) - 1, int(q * len(xs)))]
