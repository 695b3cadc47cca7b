"""The admin API's yank and unyank are all or nothing (local and S3 store): a store failure part
way through undoes the writes already made and answers a JSON 503 with Retry-After (never a
bare 500), so a failed call leaves the name exactly as it was; a store that is down before any
write answers the same."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from adapter_store import Registry
from adapter_store.errors import StoreUnavailableError
from adapter_store.versions import Registry as RegistryClass
from deployments.access.auth import KeyFile, Principal, new_key, write_key_file
from deployments.access.gate import Access, AccessError, error_response
from deployments.catalog.admin import AdminFailed, YankBody, set_yanked
from deployments.catalog.journal import JOURNAL
from deployments.config import ServerConfig, StoreConfig
from tests.support.ports import free_port

ADMIN = Principal(key_id="ops", tenant=None, admin=True)


def _live(registry: Registry, name: str) -> dict[str, bool]:
    return {v.version: not v.yanked for v in registry.versions("adapter", name)}


@pytest.fixture
def three(registry: Registry, alpha: Path, base_config: dict) -> Registry:
    for v in ("v1", "v2", "v3"):
        registry.publish_adapter(alpha, "n0", v, base_config=base_config)
    registry.yank("adapter", "n0", "v3", "staged")
    return registry


@pytest.mark.parametrize("landed", [False, True], ids=["refused", "landed-then-failed"])
def test_a_yank_that_fails_part_way_leaves_the_name_as_it_was(
    three: Registry, store_url: str, monkeypatch, landed: bool
) -> None:
    real, calls = RegistryClass.yank, []

    def flaky(self, kind, name, version, reason=None):  # type: ignore[no-untyped-def]
        calls.append(version)
        if len(calls) == 2:  # the second version: the store goes away
            if landed:  # the write reached the store, its answer did not
                real(self, kind, name, version, reason)
            raise StoreUnavailableError("store s3://x is unreachable")
        return real(self, kind, name, version, reason)

    before = _live(three, "n0")
    staged = three.backend.read_bytes("adapters/n0/v3/yanked.json")
    JOURNAL.take()
    monkeypatch.setattr(RegistryClass, "yank", flaky)
    with pytest.raises(AdminFailed) as failed:
        set_yanked(StoreConfig(url=store_url), None, "adapters", "n0", YankBody(), True)
    assert failed.value.status == 503 and "nothing was changed" in failed.value.message
    assert calls == ["v1", "v2"]
    assert _live(three, "n0") == before == {"v1": True, "v2": True, "v3": False}
    # A version yanked before keeps its own record (reason, time), not one made by the undo.
    assert three.backend.read_bytes("adapters/n0/v3/yanked.json") == staged
    # The routers are still told to re-read the name: a write may have been seen meanwhile.
    _, names = JOURNAL.take()
    assert [n.name for n in names or []] == ["n0"]


def test_an_unyank_that_fails_part_way_puts_the_yank_records_back(
    three: Registry, store_url: str, monkeypatch
) -> None:
    three.yank("adapter", "n0", "v2", "leaked")
    records = {v: three.backend.read_bytes(f"adapters/n0/{v}/yanked.json") for v in ("v2", "v3")}
    real, calls = RegistryClass.unyank, []

    def flaky(self, kind, name, version):  # type: ignore[no-untyped-def]
        calls.append(version)
        real(self, kind, name, version)
        if version == "v3":
            raise StoreUnavailableError("store s3://x is unreachable")

    monkeypatch.setattr(RegistryClass, "unyank", flaky)
    with pytest.raises(AdminFailed):
        set_yanked(StoreConfig(url=store_url), None, "adapters", "n0", YankBody(), False)
    assert _live(three, "n0") == {"v1": True, "v2": False, "v3": False}
    for v, record in records.items():
        assert three.backend.read_bytes(f"adapters/n0/{v}/yanked.json") == record


def test_a_store_that_is_down_answers_a_json_503_with_retry_after(
    tmp_path: Path, monkeypatch
) -> None:
    """Through the ingress' access layer, as the admin route calls it."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")  # credentials, but nothing listens there
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    _, entry = new_key("ops", admin=True)
    write_key_file(tmp_path / "keys.json", KeyFile(keys=[entry]))
    server = ServerConfig(auth={"enabled": True, "keys_file": str(tmp_path / "keys.json")})
    access = Access(server, 2, tmp_path)
    down = StoreConfig(url="s3://gone/adapters", endpoint_url=f"http://127.0.0.1:{free_port()}")

    async def call() -> None:
        await access.admin(ADMIN, down, "adapters", "n0", "yank", b'{"version": "v1"}')

    with pytest.raises(AccessError) as refused:
        asyncio.run(call())
    answer = error_response(refused.value)
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert b"nothing was changed" in answer.body
