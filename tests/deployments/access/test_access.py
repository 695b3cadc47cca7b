"""API keys, quotas, tenancy and the overload estimate as units (the HTTP proof is in
test_security.py)."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import pytest

from deployments.access.auth import (
    AuthConfig,
    KeyFile,
    KeyFileError,
    KeyRing,
    Principal,
    bearer_key,
    new_key,
)
from deployments.access.auth import write_key_file as write_keys
from deployments.access.overload import WaitEstimator
from deployments.access.quotas import Limits, QuotaBook, QuotaConfig, QuotaExceeded
from deployments.access.tenancy import visible_catalog
from deployments.catalog.model_names import AdapterEntry, Catalog, CompositionEntry
from deployments.ops.cli import main


def test_keys_create_stores_only_a_salted_hash(tmp_path: Path, capsys) -> None:
    path = tmp_path / "keys.json"
    assert main(["keys", "create", "--tenant", "acme", "--file", str(path)]) == 0
    key = capsys.readouterr().out.strip()
    assert main(["keys", "create", "--tenant", "acme", "--admin", "--file", str(path)]) == 0
    admin_key = capsys.readouterr().out.strip()
    text = path.read_text()
    assert key not in text and key.split("_", 2)[2] not in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    entries = json.loads(text)["keys"]
    assert [(e["tenant"], e["admin"]) for e in entries] == [("acme", False), ("acme", True)]
    assert {e["key_id"] for e in entries} == {key.split("_", 2)[1], admin_key.split("_", 2)[1]}

    ring = KeyRing(AuthConfig(enabled=True, keys_file=str(path)))
    assert ring.verify(key) == Principal(key.split("_", 2)[1], "acme", False)
    assert ring.verify(admin_key).admin is True
    assert ring.verify(key) is not None  # cached path
    wrong = key[:-2] + ("AA" if not key.endswith("AA") else "BB")
    assert ring.verify(wrong) is None
    assert ring.verify("mlr_000000000000_" + "x" * 43) is None
    assert ring.verify("not-a-key") is None
    assert ring.verify(None) is None
    assert main(["keys", "list", "--file", str(path)]) == 0
    listed = capsys.readouterr().out
    assert "acme" in listed and entries[0]["hash"] not in listed


def test_revocation_is_picked_up_on_reload(tmp_path: Path, capsys) -> None:
    path = tmp_path / "keys.json"
    key, entry = new_key("acme")
    write_keys(path, KeyFile(keys=[entry]))
    ring = KeyRing(AuthConfig(enabled=True, keys_file=str(path), reload_s=0.01))
    assert ring.verify(key) is not None
    assert main(["keys", "revoke", entry.key_id, "--file", str(path)]) == 0
    time.sleep(0.02)
    assert ring.verify(key) is None


def test_keys_from_env_and_bad_files(tmp_path: Path, monkeypatch) -> None:
    key, entry = new_key("globex")
    monkeypatch.setenv("TEST_MOLORA_KEYS", KeyFile(keys=[entry]).model_dump_json())
    ring = KeyRing(AuthConfig(enabled=True, keys_env="TEST_MOLORA_KEYS"))
    assert ring.verify(key).tenant == "globex"
    bad = tmp_path / "bad.yaml"
    bad.write_text("keys: [{key_id: nothex, tenant: x, salt: s, hash: h}]\n")
    with pytest.raises(KeyFileError, match="invalid") as err:
        KeyRing(AuthConfig(enabled=True, keys_file=str(bad)))
    assert "nothex" not in str(err.value)  # values are never echoed
    with pytest.raises(ValueError, match="neither keys_file nor keys_env"):
        AuthConfig(enabled=True)


def test_bearer_parsing() -> None:
    assert bearer_key("Bearer abc") == "abc"
    assert bearer_key("bearer  abc ") == "abc"
    assert bearer_key("Basic abc") is None
    assert bearer_key("Bearer ") is None
    assert bearer_key(None) is None


def test_quota_limits_inherit_key_over_tenant_over_default() -> None:
    cfg = QuotaConfig(
        default=Limits(requests_per_min=60, max_concurrent=4),
        tenants={"acme": Limits(requests_per_min=10)},
        keys={"k1": Limits(max_concurrent=1)},
    )
    assert cfg.limits_for(Principal("k1", "acme")) == Limits(requests_per_min=10, max_concurrent=1)
    assert cfg.limits_for(Principal("k2", "other")).requests_per_min == 60


def test_request_bucket_refuses_with_an_honest_retry_after() -> None:
    book = QuotaBook(QuotaConfig(default=Limits(requests_per_min=6)), lease_timeout_s=60)
    who = Principal("k", "t")
    for _ in range(6):
        book.admit(who, 8, busy_s=1).release(8)
    with pytest.raises(QuotaExceeded) as exc:
        book.admit(who, 8, busy_s=1)
    # 6/min = one every 10 s, and the bucket is empty.
    assert 9.0 < exc.value.retry_after_s <= 10.0


def test_token_bucket_charges_up_front_and_settles() -> None:
    book = QuotaBook(QuotaConfig(default=Limits(tokens_per_min=100)), lease_timeout_s=60)
    who = Principal("k", "t")
    lease = book.admit(who, 60, busy_s=1)
    with pytest.raises(QuotaExceeded, match="token rate"):
        book.admit(who, 60, busy_s=1)  # 40 left < 60
    lease.release(10)  # used 10 of 60: 50 refunded
    book.admit(who, 60, busy_s=1).release(90)  # used 90: 30 more charged, level ~ 0
    with pytest.raises(QuotaExceeded) as exc:
        book.admit(who, 30, busy_s=1)
    assert 17 < exc.value.retry_after_s <= 18.1  # 30 tokens at 100/min


def test_concurrency_cap_and_lease_expiry() -> None:
    book = QuotaBook(QuotaConfig(default=Limits(max_concurrent=2)), lease_timeout_s=0.05)
    who = Principal("k", "t")
    a = book.admit(who, 1, busy_s=3.2)
    book.admit(who, 1, busy_s=3.2)
    with pytest.raises(QuotaExceeded, match="concurrent") as exc:
        book.admit(who, 1, busy_s=3.2)
    assert exc.value.retry_after_s == 3.2
    a.release(1)
    a.release(1)  # idempotent
    book.admit(who, 1, busy_s=1)
    time.sleep(0.06)  # leaked leases expire after the request timeout
    book.admit(who, 1, busy_s=1)
    book.admit(who, 1, busy_s=1)


def test_tenancy_hides_private_names_and_compositions_over_them() -> None:
    catalog = Catalog(
        adapters={
            "pub": AdapterEntry("pub"),
            "mine": AdapterEntry("mine", tenant="acme"),
            "theirs": AdapterEntry("theirs", tenant="globex"),
        },
        compositions={
            "open": CompositionEntry("open", adapters=("pub@1",)),
            "leaky": CompositionEntry("leaky", adapters=("pub@1", "theirs@1")),
            "own": CompositionEntry("own", adapters=("mine@1", "pub@1"), tenant="acme"),
        },
    )
    acme = visible_catalog(catalog, "acme")
    assert set(acme.adapters) == {"pub", "mine"}
    assert set(acme.compositions) == {"open", "own"}
    anonymous = visible_catalog(catalog, None)
    assert set(anonymous.adapters) == {"pub"} and set(anonymous.compositions) == {"open"}
    assert set(visible_catalog(catalog, "globex").compositions) == {"open", "leaky"}


def test_wait_estimate_follows_queue_and_service_time() -> None:
    est = WaitEstimator(floor_s=1, slots=2)
    assert est.retry_after() == 1
    starts = [est.start() for _ in range(6)]
    for s in starts[:2]:
        est.mean_s = None
        est.finish(s - 4.0)  # pretend they took 4 s
    # 4 in flight + the new one = 3 batches of 2, ~4 s each.
    assert 12 <= est.retry_after() <= 13
    for s in starts[2:]:
        est.finish(s, ok=False)
    assert est.in_flight == 0 and 4 <= est.retry_after() <= 5


def test_startup_warns_loudly_when_auth_is_off(tmp_path: Path, caplog) -> None:
    import logging

    from deployments.access.gate import Access
    from deployments.config import ServerConfig

    logger = logging.getLogger("ray.serve")
    logger.addHandler(caplog.handler)  # Ray may have turned propagation off
    try:
        with caplog.at_level(logging.INFO, logger="ray.serve"):
            Access(ServerConfig(), slots=2, root=tmp_path).announce()
            key, entry = new_key("acme")
            write_keys(tmp_path / "k.json", KeyFile(keys=[entry]))
            on = ServerConfig(auth={"enabled": True, "keys_file": "k.json"})
            Access(on, slots=2, root=tmp_path).announce()
    finally:
        logger.removeHandler(caplog.handler)
    (warning,) = {r.getMessage() for r in caplog.records if r.levelno == logging.WARNING}
    assert "UNAUTHENTICATED" in warning
    assert any("1 API key(s)" in r.getMessage() for r in caplog.records)
    assert not any(key in r.getMessage() for r in caplog.records)
    with pytest.raises(KeyFileError, match="cannot load API keys"):
        Access(ServerConfig(auth={"enabled": True, "keys_file": "nope.json"}), 2, tmp_path)


def test_shipped_configs_auth_off_locally_and_on_for_the_cluster() -> None:
    import yaml

    from deployments.config import REPO_ROOT, ServeConfig

    def server(name: str):
        app = yaml.safe_load((REPO_ROOT / name).read_text())["applications"][0]
        return ServeConfig.from_args(app["args"]).server

    assert server("serve_config.yaml").auth.enabled is False
    gpu = server("serve_config.gpu.yaml")
    assert gpu.auth.enabled and gpu.auth.keys_file == "/etc/molora/api-keys/keys.json"
    assert gpu.quotas.default.max_concurrent is not None


async def test_first_use_of_a_key_does_not_block_the_event_loop(tmp_path: Path) -> None:
    import asyncio

    keys = [new_key("acme") for _ in range(3)]
    write_keys(tmp_path / "k.json", KeyFile(keys=[e for _, e in keys]))
    ring = KeyRing(AuthConfig(enabled=True, keys_file=str(tmp_path / "k.json")))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    start = asyncio.get_running_loop().time()
    found = await asyncio.gather(*(ring.verify_async(k) for k, _ in keys))
    took = asyncio.get_running_loop().time() - start
    task.cancel()
    assert [p.tenant for p in found] == ["acme"] * 3
    assert ticks >= 0.3 * took / 0.005  # the loop kept running while scrypt did
    assert await ring.verify_async(keys[0][0] + "x") is None
