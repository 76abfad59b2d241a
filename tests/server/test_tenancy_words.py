"""What the tenancy policy tells the operator and a refused client, word for word: the startup line
(``describe``), who may read /metrics and why (``metrics_access``), every refusal's message. These are the
security model as the operator reads it; a change of meaning must be a deliberate change here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlab.server.tenancy import AuthError, MetricsClosedError, TenancyConfigError, TenancyPolicy, parse_api_keys

# Recorded from the policy when this test was written; a change of wording is a deliberate edit of the file.
GOLDEN = json.loads((Path(__file__).parent / "tenancy_words.json").read_text(encoding="utf-8"))
SEND = "send 'Authorization: Bearer <key>'"


@pytest.mark.parametrize("case", GOLDEN, ids=[str(i) for i in range(len(GOLDEN))])
def test_the_startup_line_and_the_metrics_rule_word_for_word(case) -> None:
    policy = TenancyPolicy(**case["config"])
    got = policy.metrics_access()
    assert policy.describe() == case["describe"]
    assert [got.mode, got.reason, got.reveals] == case["metrics_access"]


def test_every_refusal_says_what_is_wrong() -> None:
    keyed = TenancyPolicy(api_keys={"k1": "a"}, metrics_api_key="m")
    cases = [
        (lambda: keyed.tenant(None), f"this server requires an API key: {SEND}"),
        (lambda: keyed.tenant("Bearer nope"), "the API key is not valid"),
        (
            lambda: keyed.check_any_key("Basic k1"),
            f"this server requires an API key: {SEND}",
        ),
        (lambda: keyed.check_any_key("Bearer nope"), "the API key is not valid"),
        (
            lambda: keyed.check_metrics(None),
            f"/metrics requires the metrics API key: {SEND}",
        ),
        (lambda: keyed.check_metrics("Bearer k1"), "the metrics API key is not valid"),  # a tenant's key never opens it
    ]
    for call, message in cases:
        with pytest.raises(AuthError) as info:
            call()
        assert str(info.value) == message
    with pytest.raises(MetricsClosedError) as closed:
        TenancyPolicy(api_keys={"k1": "a"}).check_metrics("Bearer k1")
    assert str(closed.value).startswith("/metrics is closed: it would reveal every request's")


def test_what_each_access_check_lets_through() -> None:
    keyed = TenancyPolicy(api_keys={"k1": "a"})  # no metrics key: check_any_key must not choke on its absence
    keyed.check_any_key("Bearer k1")
    assert keyed.tenant("Bearer  k1") == "a"  # the token is what follows the scheme, spaces around it dropped
    metrics = TenancyPolicy(api_keys={"k1": "a"}, metrics_api_key="m")
    metrics.check_any_key("Bearer m")  # the metrics key opens the pages about the server too
    metrics.check_metrics("Bearer m")
    TenancyPolicy(report_cached_tokens="exact").check_metrics(None)  # open: it tells nothing responses do not


def test_salts_by_sharing_mode() -> None:
    per_tenant = TenancyPolicy()
    assert per_tenant.cache_salt("a", None) == '["a", null]' and per_tenant.cache_salt("a", "x") == '["a", "x"]'
    assert TenancyPolicy(prefix_sharing="global").cache_salt("a", None) is None
    assert TenancyPolicy(prefix_sharing="off").cache_salt("a", "x") is None  # the engine has no prefix cache


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"": "t"}, "API keys and tenants must be non-empty and keys without whitespace (tenant 't')"),
        ({"k": ""}, "API keys and tenants must be non-empty and keys without whitespace (tenant '')"),
        ({"a b": "t"}, "API keys and tenants must be non-empty and keys without whitespace (tenant 't')"),
    ],
)
def test_a_bad_key_or_tenant_is_refused(keys, message) -> None:
    with pytest.raises(TenancyConfigError) as info:
        TenancyPolicy(api_keys=keys)
    assert str(info.value) == message


def test_the_metrics_key_refusals_word_for_word() -> None:
    for kw, message in [
        ({"metrics_api_key": "a b"}, "the metrics API key must be non-empty and without spaces"),
        ({"metrics_api_key": "m", "public_metrics": True},
         "--public-metrics opens /metrics to anyone: it cannot go with --metrics-api-key"),
        ({"metrics_api_key": "k", "api_keys": {"k": "t"}},
         "the metrics API key is also the API key of tenant 't': give /metrics a key of its own"),
    ]:  # fmt: skip
        with pytest.raises(TenancyConfigError) as info:
            TenancyPolicy(**kw)
        assert str(info.value) == message


def test_a_keys_file_comment_ends_the_line_and_duplicates_are_named_by_position(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("k1 team # a comment # with a second hash\nk2 # only a key\n")
    assert parse_api_keys([], f) == {"k1": "team", "k2": "tenant-2"}
    with pytest.raises(TenancyConfigError) as info:
        parse_api_keys(["k0", "k1", "k1"])
    assert str(info.value) == "API key #3 is given twice"


def test_an_automatic_tenant_name_taken_explicitly_is_refused_word_for_word() -> None:
    with pytest.raises(TenancyConfigError) as info:
        parse_api_keys(["k1", "k2:tenant-1"])
    assert str(info.value) == (
        "API key #1 has no tenant, so it would be tenant 'tenant-1', which another key names explicitly: "
        "give it a tenant of its own (KEY:TENANT)"
    )
