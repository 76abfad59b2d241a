"""The probe's client against a live stand-in: where its requests go, and what it reads from the answers."""

from __future__ import annotations

import pytest

from kvlab.openai_http import cached_tokens_of
from kvlab.probe.client import HTTPStatusError, ProbeClient


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "/"])
def test_a_base_url_with_v1_reaches_v1_completions(standin, suffix: str) -> None:
    """The CLI stripped ``/v1``, the library did not: ``ProbeClient("http://host:port/v1")`` posted to
    ``/v1/v1/completions`` (a 404 from every server)."""
    url = standin(reject_unknown=True)
    with ProbeClient(url + suffix, "toy") as client:
        assert client.base_url == url
        data, _ = client.completion("Say hello.", 2)
        assert data["choices"][0]["text"]
        # The stand-in refuses cache_salt with 422: the error names the URL actually requested.
        with pytest.raises(HTTPStatusError) as refused:
            client.completion("Say hello.", 2, salt="s")
    assert refused.value.status == 422 and refused.value.url == f"{url}/v1/completions"


def test_llama_cpp_cache_reports_are_read(standin) -> None:
    """llama.cpp reports a cache hit in ``timings.cache_n``, not in the usage."""
    url = standin(report_cached="timings")
    prompt = "A prompt long enough to be cached by the stand-in, and found again."
    with ProbeClient(url + "/v1", "toy") as client:
        first, _ = client.completion(prompt, 2)
        again, _ = client.completion(prompt, 1)
    assert "prompt_tokens_details" not in again["usage"]
    assert cached_tokens_of(first) == 0 and cached_tokens_of(again) == len(prompt) - 1
