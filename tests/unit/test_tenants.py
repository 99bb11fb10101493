"""Keys by tenant (serve/tenants.py): digests only, every key checked, operators apart; cache scopes per tenant and
salt; readiness per model (serve/health.py) from Serve's status, one deployment down leaving the others ready."""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace

import pytest
from pydantic import SecretStr

from s2d_ray.serve import health
from s2d_ray.serve.app_config import TenantsConfig
from s2d_ray.serve.http_api import ApiError
from s2d_ray.serve.tenants import TenantKeys, end_user_scope, scoped_seq_id, store_scope
from s2d_ray.core.rows import cache_scope


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def request(header: str | None) -> SimpleNamespace:
    return SimpleNamespace(headers={"authorization": header} if header is not None else {})


@pytest.fixture
def keys(tmp_path, monkeypatch) -> TenantKeys:
    monkeypatch.delenv("S2D_API_KEY", raising=False)
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys:\n  - {{tenant: team-a, sha256: {sha('ka')}}}\n"
                    f"  - {{tenant: team-a, sha256: {sha('ka2')}}}\n"
                    f"  - {{tenant: team-b, sha256: {sha('kb')}}}\n")
    return TenantKeys.from_config(SecretStr("legacy"), TenantsConfig(keys_file=str(path)))


def test_each_key_names_its_tenant_and_the_legacy_key_is_the_default_operator(keys):
    assert keys.names == ["default", "team-a", "team-b"]
    assert keys.authenticate(request("Bearer ka")).name == "team-a"
    assert keys.authenticate(request("bearer ka2")).name == "team-a"  # two keys of one tenant (rotation)
    assert keys.authenticate(request("Bearer kb")).name == "team-b"
    assert keys.authenticate(request("Bearer legacy")).operator
    for bad in (None, "", "Bearer", "Bearer k", "Bearer kaa", f"Bearer {sha('ka')}", "Basic ka", "ka", "Token ka"):
        with pytest.raises(ApiError) as err:
            keys.authenticate(request(bad))
        assert err.value.status == 401
    with pytest.raises(ApiError) as err:
        keys.require_operator(request("Bearer ka"))
    assert err.value.status == 403
    assert keys.require_operator(request("Bearer legacy")).name == "default"


def test_no_keys_is_one_open_tenant(monkeypatch):
    monkeypatch.delenv("S2D_API_KEY", raising=False)
    monkeypatch.delenv("S2D_API_KEYS_FILE", raising=False)
    keys = TenantKeys.from_config(None, TenantsConfig())
    assert keys.open and keys.authenticate(request(None)).operator
    assert keys.cache_scope(keys.authenticate(request(None)).name, None) == ""  # the caches as with no tenants


@pytest.mark.parametrize("text, field", [
    ("keys: []", "keys"),
    ("keys:\n  - {tenant: a, sha256: plain-key}", "keys.0.sha256"),
    ("keys:\n  - {tenant: 'a:b', sha256: " + "0" * 64 + "}", "keys.0.tenant"),
    ("keys:\n  - {tenant: a, key: x, sha256: " + "0" * 64 + "}", "keys.0.key"),
    ("[", "keys_file"),
])
def test_a_bad_keys_file_names_the_field(tmp_path, text, field):
    path = tmp_path / "k.yaml"
    path.write_text(text)
    last = field.split(".")[-1] if field != "keys_file" else ""
    with pytest.raises(ValueError, match=f"tenants.keys_file {path}.*{last}"):
        TenantKeys.from_config(None, TenantsConfig(keys_file=str(path)))


def test_scopes_separate_tenants_and_salts_unless_shared():
    tenant, shared = TenantKeys([], "tenant"), TenantKeys([], "shared")
    a, b = tenant.cache_scope("a", None), tenant.cache_scope("b", None)
    assert a and b and a != b and a == tenant.cache_scope("a", None)
    assert tenant.cache_scope("a", "s") not in (a, tenant.cache_scope("b", "s"))
    assert shared.cache_scope("a", None) == shared.cache_scope("b", None) == ""  # the negative control
    assert shared.cache_scope("a", "s") == shared.cache_scope("b", "s") != ""
    seq = scoped_seq_id(a, "0123abcd")
    assert cache_scope(seq) == a and cache_scope(scoped_seq_id("", "0123abcd")) == ""
    user = end_user_scope("u1", None)
    assert store_scope(a, user) != store_scope(b, user) and store_scope(a, None) == a
    assert end_user_scope(None, None) is None


def probe(running: dict, draft: str | None = "draft") -> health.ReadinessProbe:
    return health.ReadinessProbe(lambda: dict(running), {"m1": "target-m1", "m2": "target-m2", "m3": None}, draft)


def test_one_deployment_down_leaves_the_others_ready():
    r = asyncio.run(probe({"target-m1": 1, "target-m2": 0, "draft": 0}).check())
    assert r.models == {"m1": True, "m2": False, "m3": True} and r.draft is False
    assert r.body()["status"] == "degraded"
    r = asyncio.run(probe({"target-m1": 2, "target-m2": 1}, draft=None).check())
    assert r.body() == {"status": "ready", "models": {m: {"ready": True} for m in ("m1", "m2", "m3")}}


def test_a_silent_controller_keeps_the_last_answer_then_says_unknown(monkeypatch):
    calls = {"n": 0}

    def read():
        calls["n"] += 1
        if calls["n"] > 1:
            raise TimeoutError
        return {"target-m1": 1, "target-m2": 1}

    p = health.ReadinessProbe(read, {"m1": "target-m1", "m2": "target-m2"}, None)
    assert all(asyncio.run(p.check()).models.values())
    monkeypatch.setattr(health, "READY_TTL_S", -1.0)
    assert all(asyncio.run(p.check()).models.values())  # a failed call: the last answer still stands
    monkeypatch.setattr(health, "STALE_AFTER_S", -1.0)
    r = asyncio.run(p.check())
    assert not any(r.models.values()) and "Serve controller" in r.body()["error"]
