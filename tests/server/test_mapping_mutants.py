"""``server.mapping`` held to its whole contract: every refusal's status, message, ``param`` and code, every
boundary, every request field into ``SamplingParams`` and the ``Job``. Written for the mutants of issue 40 that
the suite let live (docs/mutation-survivors.md): a refusal is what a client reads, so its words are pinned
as the API they are, and the cache salt's every branch is pinned because a salt decides who shares K/V."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from kvlab.engine.sampling import InvalidRequestError
from kvlab.server.errors import APIError
from kvlab.server.mapping import (
    RequestMapper,
    cache_salt,
    check_sequences,
    include_usage,
    sampling_field,
    sampling_params,
)
from kvlab.server.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from kvlab.server.tenancy import TenancyPolicy


class Template:
    """Renders ``<role>content`` and records each call; ``fail`` makes it raise instead."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail = fail
        self.rendered: list[list[dict[str, str]]] = []

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if self.fail is not None:
            raise self.fail
        self.rendered.append(messages)
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)


def mapper(tokenizer: Any = None, **kw: Any) -> RequestMapper:
    limits: dict[str, Any] = dict(model_name="m", max_model_len=8, max_prompt_chars=10, max_prompts=3, vocab_size=50)
    return RequestMapper(tokenizer=tokenizer or Template(), **{**limits, **kw})


def refusal(call: Any) -> tuple[int, str, str | None, str | None]:
    with pytest.raises(APIError) as err:
        call()
    e = err.value
    return e.status, e.message, e.param, e.code


def completion(**body: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "a", **body})


def chat(*contents: str, **body: Any) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": c} for c in contents]
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **body})


# -- the model -----------------------------------------------------------------------------------------------
def test_the_model_is_checked_by_name_and_absent_is_accepted() -> None:
    m = mapper()
    m.check_model(completion())
    m.check_model(TokenizeRequest(prompt="a"))  # a body without a model names none to refuse
    assert refusal(lambda: m.check_model(completion(model="other"))) == (
        404, "the model 'other' does not exist; this server serves 'm'", "model", "model_not_found",
    )  # fmt: skip


# -- completions ---------------------------------------------------------------------------------------------
def test_a_completion_takes_at_most_max_prompts_prompts() -> None:
    m = mapper()
    assert len(m.completion_job(completion(prompt=["a", "b", "c"])).prompts) == 3
    assert refusal(lambda: m.completion_job(completion(prompt=["a"] * 4))) == (
        400, "4 prompts; this server queues at most 3", "prompt", None,
    )  # fmt: skip


def test_every_prompt_of_a_completion_is_checked() -> None:
    m = mapper()
    status, message, param, _ = refusal(lambda: m.completion_job(completion(prompt=["a", "y" * 11])))
    assert (status, param) == (400, "prompt") and message.startswith("the prompt has 11 characters")


def test_a_completion_job_carries_every_field() -> None:
    job = mapper(max_tokens_default=5).completion_job(completion())
    assert (job.chat, list(job.prompts), job.stream, job.include_usage, job.echo) == (False, ["a"], False, False, False)
    assert (job.logprobs, job.public_prefix_tokens, job.return_token_ids) == (None, 0, False)
    assert (job.params.max_tokens, job.params.logprobs, job.params.prompt_logprobs) == (5, None, None)
    job = mapper().completion_job(
        completion(max_tokens=3, logprobs=2, kvlab_public_prefix_tokens=4, return_token_ids=True)
    )
    assert (job.params.max_tokens, job.params.logprobs, job.params.prompt_logprobs) == (3, 2, None)
    assert (job.logprobs, job.public_prefix_tokens, job.return_token_ids, job.echo) == (2, 4, True, False)
    job = mapper().completion_job(completion(echo=True, logprobs=1))
    assert (job.echo, job.params.prompt_logprobs) == (True, 1)


# -- chat ----------------------------------------------------------------------------------------------------
def test_top_logprobs_needs_logprobs() -> None:
    m = mapper()
    assert refusal(lambda: m.chat_job(chat("hi", top_logprobs=2))) == (
        400, "'top_logprobs' needs 'logprobs': true", "top_logprobs", None,
    )  # fmt: skip
    assert refusal(lambda: m.chat_job(chat("hi", top_logprobs=2, logprobs=False)))[2] == "top_logprobs"
    job = m.chat_job(chat("hi", top_logprobs=2, logprobs=True))
    assert job.logprobs == job.params.logprobs == 2
    job = m.chat_job(chat("hi", logprobs=False))
    assert job.logprobs is None and job.params.logprobs is None


def test_a_chat_job_carries_every_field() -> None:
    m = mapper()
    job = m.chat_job(chat("hi"))
    assert (job.chat, list(job.prompts), job.stream, job.include_usage, job.echo) == (
        True, ["<user>hi"], False, False, False,
    )  # fmt: skip
    assert (job.logprobs, job.public_prefix_tokens, job.return_token_ids, job.params.max_tokens) == (
        None, 0, False, None,
    )  # fmt: skip
    job = m.chat_job(
        chat("hi", max_tokens=4, stream=True, stream_options={"include_usage": True}, kvlab_public_prefix_tokens=2,
             return_token_ids=True)
    )  # fmt: skip
    assert (job.params.max_tokens, job.stream, job.include_usage, job.public_prefix_tokens, job.return_token_ids) == (
        4, True, True, 2, True,
    )  # fmt: skip
    assert m.chat_job(chat("hi", max_tokens=4, max_completion_tokens=2)).params.max_tokens == 2


def test_a_chat_prompt_is_checked_after_rendering() -> None:
    m = mapper()  # 10 characters: "<user>" is 6 of them
    assert m.chat_job(chat("abcd")).prompts == ["<user>abcd"]
    status, message, param, _ = refusal(lambda: m.chat_job(chat("abcde")))
    assert (status, param) == (400, "messages")
    assert message == "the prompt has 11 characters; at most 10 can fit max_model_len=8 tokens"


# -- the template --------------------------------------------------------------------------------------------
def test_render_refuses_more_messages_than_tokens() -> None:
    m = mapper(max_prompt_chars=100)
    assert m.render(chat(*"a" * 8).messages) == "<user>a" * 8
    assert refusal(lambda: m.render(chat(*"a" * 9).messages)) == (
        400, "9 messages cannot fit max_model_len=8 tokens", "messages", None,
    )  # fmt: skip


def test_render_names_the_message_with_a_lone_surrogate() -> None:
    m = mapper()
    assert refusal(lambda: m.render(chat("a", "b\ud800").messages)) == (
        400, "messages[1].content is not valid Unicode: a lone surrogate '\\ud800' at character 1", "messages", None,
    )  # fmt: skip


def test_render_counts_the_characters_of_all_messages_before_the_template() -> None:
    template = Template()
    m = mapper(template)
    assert m.render(chat("abcde", "fghij").messages) == "<user>abcde<user>fghij"  # 10 characters of content
    assert template.rendered == [[{"role": "user", "content": "abcde"}, {"role": "user", "content": "fghij"}]]
    assert refusal(lambda: m.render(chat("abcde", "fghijk").messages)) == (
        400, "the messages have 11 characters; at most 10 can fit max_model_len=8 tokens", "messages", None,
    )  # fmt: skip
    assert len(template.rendered) == 1, "refused before the template ran"


def test_a_template_refusal_is_a_400_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    m = mapper(Template(ValueError("roles must alternate")))
    assert refusal(lambda: m.render(chat("a").messages)) == (
        400, "the chat template refused these messages: roles must alternate", "messages", None,
    )  # fmt: skip
    broken = mapper(Template(KeyError("x" * 300)))
    with caplog.at_level(logging.WARNING, logger="kvlab.server.mapping"):
        assert refusal(lambda: broken.render(chat("a").messages)) == (
            400, "the model's chat template could not render these messages", "messages", None,
        )  # fmt: skip
    [record] = [r for r in caplog.records if r.name == "kvlab.server.mapping"]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == "the chat template failed: KeyError " + repr(repr("x" * 300))[:200]


# -- tokenize / detokenize -----------------------------------------------------------------------------------
def test_tokenize_takes_exactly_one_of_prompt_and_messages() -> None:
    m = mapper()
    assert m.tokenize_text(TokenizeRequest(prompt="abc")) == "abc"
    assert m.tokenize_text(TokenizeRequest(messages=chat("hi").messages)) == "<user>hi"
    message = (400, "give exactly one of 'prompt' and 'messages'", "prompt", None)
    assert refusal(lambda: m.tokenize_text(TokenizeRequest())) == message
    assert refusal(lambda: m.tokenize_text(TokenizeRequest(prompt="a", messages=chat("hi").messages))) == message
    assert refusal(lambda: m.tokenize_text(TokenizeRequest(prompt="y" * 11)))[2] == "prompt"
    assert refusal(lambda: m.tokenize_text(TokenizeRequest(messages=chat("abcde").messages)))[2] == "prompt"


def test_detokenize_refuses_the_first_id_outside_the_vocabulary() -> None:
    m = mapper()
    m.check_tokens(DetokenizeRequest(tokens=[0, 49]))
    assert refusal(lambda: m.check_tokens(DetokenizeRequest(tokens=[0, 50, 99]))) == (
        400, "tokens[1] = 50 is outside the vocabulary [0, 50)", "tokens", None,
    )  # fmt: skip


# -- prompt sizes --------------------------------------------------------------------------------------------
def test_a_prompt_at_the_limits_is_accepted_and_one_past_is_refused() -> None:
    m = mapper()
    m.check_prompt(list(range(8)))
    m.check_prompt("y" * 10)
    assert refusal(lambda: m.check_prompt(list(range(9)), "input")) == (
        400, "the prompt has 9 tokens, more than max_model_len=8", "input", None,
    )  # fmt: skip
    assert refusal(lambda: m.check_prompt("y" * 11)) == (
        400, "the prompt has 11 characters; at most 10 can fit max_model_len=8 tokens", "prompt", None,
    )  # fmt: skip
    assert refusal(lambda: m.check_prompt("a\udc00", "input")) == (
        400, "the prompt is not valid Unicode: a lone surrogate '\\udc00' at character 1", "input", None,
    )  # fmt: skip


# -- sampling ------------------------------------------------------------------------------------------------
def test_an_unset_field_takes_vllm_s_default() -> None:
    p = sampling_params(completion(), 7, None)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, None, 7)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens) == (0.0, 0.0, 1.0, 0)
    assert (p.stop, p.stop_token_ids, p.bad_words, p.logit_bias, p.allowed_token_ids) == ((), (), (), None, None)
    assert (p.include_stop_str_in_output, p.ignore_eos, p.truncate_prompt_tokens) == (False, False, None)
    assert (p.skip_special_tokens, p.spaces_between_special_tokens, p.logprobs, p.prompt_logprobs) == (
        True, True, None, None,
    )  # fmt: skip


def test_every_sampling_field_reaches_sampling_params() -> None:
    req = completion(
        n=2, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, presence_penalty=0.2, frequency_penalty=0.3,
        repetition_penalty=1.1, seed=9, stop=["x", "yz"], stop_token_ids=[3], include_stop_str_in_output=True,
        ignore_eos=True, min_tokens=1, logit_bias={"4": 2.0}, allowed_token_ids=[4, 6], bad_words=["no"],
        truncate_prompt_tokens=6, skip_special_tokens=False, spaces_between_special_tokens=False,
    )  # fmt: skip
    p = sampling_params(req, 3, 2, 1)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.max_tokens) == (2, 0.5, 0.9, 5, 0.1, 9, 3)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens) == (0.2, 0.3, 1.1, 1)
    assert (p.stop, p.stop_token_ids, p.bad_words) == (("x", "yz"), (3,), ("no",))
    assert p.logit_bias is not None and dict(p.logit_bias) == {4: 2.0}
    assert p.allowed_token_ids is not None and list(p.allowed_token_ids) == [4, 6]
    assert (p.include_stop_str_in_output, p.ignore_eos, p.truncate_prompt_tokens) == (True, True, 6)
    assert (p.skip_special_tokens, p.spaces_between_special_tokens, p.logprobs, p.prompt_logprobs) == (
        False, False, 2, 1,
    )  # fmt: skip
    assert sampling_params(completion(stop="x"), 1, None).stop == ("x",)
    assert (sampling_params(completion(temperature=0, top_k=0), 1, None).temperature, p.top_k) == (0, 5)


def test_client_texts_with_a_lone_surrogate_are_refused_by_name() -> None:
    assert refusal(lambda: sampling_params(completion(stop=["ok", "\ud800"]), 1, None)) == (
        400, "stop[1] is not valid Unicode: a lone surrogate '\\ud800' at character 0", "stop", None,
    )  # fmt: skip
    assert refusal(lambda: sampling_params(completion(bad_words=["ok", "b\ud800"]), 1, None)) == (
        400, "bad_words[1] is not valid Unicode: a lone surrogate '\\ud800' at character 1", "bad_words", None,
    )  # fmt: skip


def test_a_sampling_refusal_names_its_field() -> None:
    status, message, param, code = refusal(lambda: sampling_params(completion(min_tokens=5), 2, None))
    assert (status, param, code) == (400, "min_tokens", None) and "min_tokens" in message
    assert sampling_field(InvalidRequestError("SamplingParams.top_k must be >= -1")) == "top_k"
    assert sampling_field(InvalidRequestError("n must be >= 1")) is None


# -- usage, sequences ----------------------------------------------------------------------------------------
def test_usage_is_included_only_when_a_stream_asks() -> None:
    assert include_usage(completion()) is False
    assert include_usage(completion(stream=True)) is False
    assert include_usage(completion(stream=True, stream_options={"include_usage": False})) is False
    assert include_usage(completion(stream=True, stream_options={"include_usage": True})) is True
    assert refusal(lambda: include_usage(completion(stream_options={"include_usage": True}))) == (
        400, "'stream_options' is only allowed with 'stream': true", "stream_options", None,
    )  # fmt: skip


def test_sequences_are_prompts_times_n_and_the_field_named_is_the_one_over() -> None:
    m = mapper()
    job = m.completion_job(completion(prompt=["a", "b"], n=3))
    check_sequences(job, 6)
    assert refusal(lambda: check_sequences(job, 5)) == (
        400,
        "2 prompt(s) x n=3 = 6 sequences; this server takes at most 5 in one request (kvlab serve --max-request-seqs)",
        "n",
        None,
    )
    many = m.completion_job(completion(prompt=["a", "b", "c"]))
    check_sequences(many, 3)
    assert refusal(lambda: check_sequences(many, 2))[2] == "prompt"
    assert refusal(lambda: check_sequences(m.completion_job(completion(prompt=["a", "b"], n=2)), 2))[2] == "n"


# -- the cache salt ------------------------------------------------------------------------------------------
def test_the_salt_header_is_refused_unless_a_trusted_proxy_sends_it() -> None:
    closed = TenancyPolicy()
    assert refusal(lambda: cache_salt(closed, "t", ["h"], None)) == (
        400,
        "this server does not accept X-Cache-Salt (it is for a trusted proxy: --trust-salt-header); "
        "send 'cache_salt' in the body",
        "cache_salt",
        None,
    )
    proxy = TenancyPolicy(trust_salt_header=True)
    for policy in (closed, proxy):
        assert refusal(lambda p=policy: cache_salt(p, "t", ["h", "h"], None)) == (  # type: ignore[misc]
            400, "the X-Cache-Salt header is given more than once", "cache_salt", None,
        )  # fmt: skip
    assert cache_salt(proxy, "t", ["h"], None) == json.dumps(["t", "h"])
    assert cache_salt(proxy, "t", [], "b") == json.dumps(["t", "b"])
    assert cache_salt(proxy, "t", [], None) == json.dumps(["t", None])


def test_each_salt_source_is_validated_under_its_own_name() -> None:
    proxy = TenancyPolicy(trust_salt_header=True)
    assert refusal(lambda: cache_salt(proxy, "t", ["a\tb"], None)) == (
        400, "the X-Cache-Salt header must be 1..256 printable ASCII characters, got 'a\\tb'", "cache_salt", None,
    )  # fmt: skip
    assert refusal(lambda: cache_salt(proxy, "t", [], "")) == (
        400, "'cache_salt' must be 1..256 printable ASCII characters, got ''", "cache_salt", None,
    )  # fmt: skip
    # A valid header wins over an invalid body salt: the body's is not read when the proxy speaks.
    assert cache_salt(proxy, "t", ["h"], "") == json.dumps(["t", "h"])


@pytest.mark.parametrize("sharing", ["per-tenant", "global", "off"])
def test_the_salt_follows_the_operator_s_sharing(sharing: str) -> None:
    policy = TenancyPolicy(prefix_sharing=sharing)
    expected = {"per-tenant": json.dumps(["t", "s"]), "global": "s", "off": None}[sharing]
    assert cache_salt(policy, "t", [], "s") == expected
    if sharing == "per-tenant":  # no client salt of tenant u spells tenant t's salt
        assert cache_salt(policy, "u", [], None) != cache_salt(policy, "t", [], None)
        assert cache_salt(policy, "u", [], '", "t') != cache_salt(policy, "t", [], None)
