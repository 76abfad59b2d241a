"""``server.mapping``: request bodies to engine jobs, without HTTP or an engine (the routes' own tests, over HTTP,
are in test_openai_compat.py and test_hardening.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvlab.server.errors import APIError
from kvlab.server.mapping import RequestMapper, cache_salt, check_sequences
from kvlab.server.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from kvlab.server.tenancy import TenancyPolicy


class Template:
    """A tokenizer that only renders chat templates, and records what it was asked to render."""

    def __init__(self) -> None:
        self.rendered: list[list[dict[str, str]]] = []

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        self.rendered.append(messages)
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)


def mapper(tokenizer: Any = None, **kw: Any) -> RequestMapper:
    limits: dict[str, Any] = dict(model_name="m", max_model_len=64, max_prompt_chars=64, max_prompts=4, vocab_size=100)
    return RequestMapper(tokenizer=tokenizer or Template(), **{**limits, **kw})


def refusal(call: Any, status: int = 400) -> APIError:
    with pytest.raises(APIError) as err:
        call()
    assert err.value.status == status
    return err.value


def test_a_completion_becomes_one_engine_request_per_prompt() -> None:
    req = CompletionRequest.model_validate(
        {"model": "m", "prompt": ["a", "b"], "n": 2, "temperature": 0, "stop": "x", "echo": True, "logprobs": 1,
         "stream": True, "stream_options": {"include_usage": True}}
    )  # fmt: skip
    job = mapper(max_tokens_default=7).completion_job(req)
    assert (job.chat, list(job.prompts), job.stream, job.include_usage, job.echo, job.logprobs) == (
        False, ["a", "b"], True, True, True, 1,
    )  # fmt: skip
    p = job.params
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.stop) == (2, 0, 1.0, 0, 7, ("x",))
    assert p.logprobs == p.prompt_logprobs == 1  # echo with logprobs: the prompt's own come first
    assert job.sequences == 4


def test_a_chat_request_is_rendered_by_the_template() -> None:
    template = Template()
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "max_completion_tokens": 3}
    )
    job = mapper(template).chat_job(req)
    assert job.chat and list(job.prompts) == ["<user>hi"] and template.rendered == [[{"role": "user", "content": "hi"}]]
    assert job.params.max_tokens == 3 and job.logprobs == 0 and not job.include_usage


def test_refusals_name_the_field() -> None:
    m = mapper()
    assert refusal(lambda: m.check_model(CompletionRequest(model="other", prompt="a")), 404).param == "model"
    too_many = CompletionRequest(model="m", prompt=["a"] * 5)
    assert refusal(lambda: m.completion_job(too_many)).message == "5 prompts; this server queues at most 4"
    long = refusal(lambda: m.completion_job(CompletionRequest(model="m", prompt="y" * 65)))
    assert long.param == "prompt" and "65 characters; at most 64" in long.message
    assert refusal(lambda: m.check_prompt(list(range(65)))).message.startswith("the prompt has 65 tokens")
    assert refusal(lambda: m.completion_job(CompletionRequest(model="m", prompt="a", stop="\ud800"))).param == "stop"
    no_stream = CompletionRequest.model_validate({"model": "m", "prompt": "a", "stream_options": {}})
    assert refusal(lambda: m.completion_job(no_stream)).param == "stream_options"
    top = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    )
    assert refusal(lambda: m.chat_job(top)).param == "top_logprobs"
    assert refusal(lambda: m.tokenize_text(TokenizeRequest(prompt="a", messages=[]))).param == "prompt"
    assert refusal(lambda: m.check_tokens(DetokenizeRequest(tokens=[1, 100]))).message.startswith("tokens[1] = 100")
    job = m.completion_job(CompletionRequest(model="m", prompt=["a", "b"], n=3))
    assert refusal(lambda: check_sequences(job, 5)).param == "n"
    check_sequences(job, 6)


def test_the_cache_salt_starts_with_the_tenant() -> None:
    policy = TenancyPolicy()  # per-tenant sharing, X-Cache-Salt refused
    assert cache_salt(policy, "t", [], "s") == json.dumps(["t", "s"])
    assert cache_salt(policy, "t", [], None) == json.dumps(["t", None])
    assert refusal(lambda: cache_salt(policy, "t", ["h"], None)).message.startswith("this server does not accept")
    proxy = TenancyPolicy(trust_salt_header=True)
    assert cache_salt(proxy, "t", ["h"], "s") == json.dumps(["t", "h"])  # the proxy's header wins
    assert refusal(lambda: cache_salt(proxy, "t", ["h", "i"], None)).param == "cache_salt"
    assert refusal(lambda: cache_salt(proxy, "t", [], "\n")).param == "cache_salt"
