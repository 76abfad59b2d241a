"""From a validated request body (``schemas``) to what the engine runs: prompts, ``SamplingParams``, the
``Job``, the cache salt. Pure: no HTTP, no event loop; every refusal is an ``APIError`` naming the field.

The checks that need no tokenizer come first, so a prompt that could never fit ``max_model_len`` is refused
by its size before anything tokenises it (``guards.bytes_per_token_bound``)."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvlab.engine.sampling import InvalidRequestError, SamplingParams
from kvlab.server.errors import APIError, clip
from kvlab.server.guards import check_text, validate_salt
from kvlab.server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    GenerateBase,
    RequestBase,
    TokenizeRequest,
)
from kvlab.server.tenancy import TenancyPolicy

log = logging.getLogger(__name__)

_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)")


@dataclass(frozen=True)
class Job:
    """One generation request as the engine will run it: one engine request per prompt."""

    chat: bool
    prompts: Sequence[str | list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool = False
    logprobs: int | None = None  # completions: logprobs; chat: top_logprobs (None: not asked for)
    public_prefix_tokens: int = 0  # kvlab_public_prefix_tokens: each prompt's own first N tokens are public
    return_token_ids: bool = False  # vLLM's: the prompt's token ids too, and a stream's token ids chunk by chunk

    @property
    def sequences(self) -> int:
        return len(self.prompts) * self.params.n


@dataclass(frozen=True)
class RequestMapper:
    """The server's limits and tokenizer, applied to request bodies."""

    tokenizer: Any
    model_name: str
    max_model_len: int
    max_prompt_chars: int  # more characters than this cannot fit max_model_len tokens
    max_prompts: int  # prompts in one completions request: no more than the engine loop queues
    vocab_size: int
    max_tokens_default: int = 16  # completions (OpenAI's 16); chat fills the context

    def check_model(self, req: RequestBase) -> None:
        model = getattr(req, "model", None)
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {clip(model)} does not exist; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
            )

    def completion_job(self, req: CompletionRequest) -> Job:
        prompts = req.prompts()
        if len(prompts) > self.max_prompts:
            raise APIError(400, f"{len(prompts)} prompts; this server queues at most {self.max_prompts}", "prompt")
        for p in prompts:
            self.check_prompt(p, "prompt")
        max_tokens = self.max_tokens_default if req.max_tokens is None else req.max_tokens
        # echo with logprobs: the prompt's own log-probabilities come first (OpenAI's legacy "scoring" use).
        params = sampling_params(req, max_tokens, req.logprobs, req.logprobs if req.echo else None)
        return Job(
            chat=False,
            prompts=prompts,
            params=params,
            stream=req.stream,
            include_usage=include_usage(req),
            echo=req.echo,
            logprobs=req.logprobs,
            public_prefix_tokens=req.kvlab_public_prefix_tokens,
            return_token_ids=bool(req.return_token_ids),
        )

    def chat_job(self, req: ChatCompletionRequest) -> Job:
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        prompt = self.render(req.messages)
        self.check_prompt(prompt, "messages")
        # No max_tokens: up to the context limit, as vLLM's chat does (the engine stops at max_model_len).
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, max_tokens, top)
        return Job(
            chat=True,
            prompts=[prompt],
            params=params,
            stream=req.stream,
            include_usage=include_usage(req),
            logprobs=top,
            public_prefix_tokens=req.kvlab_public_prefix_tokens,
            return_token_ids=bool(req.return_token_ids),
        )

    def tokenize_text(self, req: TokenizeRequest) -> str:
        """The text ``/tokenize`` tokenises: the prompt, or the chat template's rendering of the messages."""
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", "prompt")
        text = req.prompt if req.prompt is not None else self.render(req.messages or [])
        self.check_prompt(text)
        return text

    def check_tokens(self, req: DetokenizeRequest) -> None:
        bad = next((i for i, t in enumerate(req.tokens) if t >= self.vocab_size), None)
        if bad is not None:
            raise APIError(
                400, f"tokens[{bad}] = {req.tokens[bad]} is outside the vocabulary [0, {self.vocab_size})", "tokens"
            )

    def check_prompt(self, prompt: str | list[int], param: str = "prompt") -> None:
        """Refuse by size what cannot fit max_model_len tokens, before anything tokenises it."""
        if isinstance(prompt, list):
            if len(prompt) > self.max_model_len:
                raise APIError(
                    400, f"the prompt has {len(prompt)} tokens, more than max_model_len={self.max_model_len}", param
                )
            return
        if len(prompt) > self.max_prompt_chars:
            raise APIError(
                400,
                f"the prompt has {len(prompt)} characters; at most {self.max_prompt_chars} can fit "
                f"max_model_len={self.max_model_len} tokens",
                param,
            )
        check_text(prompt, "the prompt", param)

    def render(self, messages: Sequence[ChatMessage]) -> str:
        """The chat template's prompt for ``messages``, after the checks that need no template."""
        if len(messages) > self.max_model_len:  # every message costs the chat template at least one token
            raise APIError(
                400, f"{len(messages)} messages cannot fit max_model_len={self.max_model_len} tokens", "messages"
            )
        texts = [m.text() for m in messages]
        for i, text in enumerate(texts):
            check_text(text, f"messages[{i}].content", "messages")
        size = sum(len(t) for t in texts)
        if size > self.max_prompt_chars:  # before the template renders it
            raise APIError(
                400,
                f"the messages have {size} characters; at most {self.max_prompt_chars} can fit "
                f"max_model_len={self.max_model_len} tokens",
                "messages",
            )
        try:
            return str(
                self.tokenizer.apply_chat_template(
                    [{"role": m.role, "content": t} for m, t in zip(messages, texts, strict=True)]
                )
            )
        except ValueError as exc:  # no chat template, or the template's own raise_exception
            raise APIError(400, f"the chat template refused these messages: {exc}", "messages") from None
        except Exception as exc:
            log.warning("the chat template failed: %s %.200r", type(exc).__name__, str(exc))
            raise APIError(400, "the model's chat template could not render these messages", "messages") from None


def sampling_params(
    req: GenerateBase, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
) -> SamplingParams:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    # The prompts' rule for every client text: a stop string with a lone surrogate is a client bug (decoded
    # text never has one, so it could never match), refused the same way rather than silently inert.
    for i, stop in enumerate(stops):
        check_text(stop, f"stop[{i}]", "stop")
    for i, word in enumerate(req.bad_words or []):
        check_text(word, f"bad_words[{i}]", "bad_words")
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=req.min_p,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            seed=req.seed,
            stop=tuple(stops),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=req.bias(),
            allowed_token_ids=req.allowed_token_ids,
            bad_words=tuple(req.bad_words or ()),
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
        )
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), sampling_field(exc)) from exc


def sampling_field(exc: InvalidRequestError) -> str | None:
    """The request field a ``SamplingParams`` refusal is about (its message names ``SamplingParams.<field>``)."""
    found = _SAMPLING_FIELD.search(str(exc))
    return found.group(1) if found else None


def include_usage(req: GenerateBase) -> bool:
    if req.stream_options is not None and not req.stream:
        # OpenAI refuses it too: the options would be silently without effect.
        raise APIError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
    return req.stream_options is not None and req.stream_options.include_usage


def check_sequences(job: Job, max_request_seqs: int) -> None:
    if job.sequences > max_request_seqs:
        # A 2 KB body of 256 prompts x n=64 would otherwise queue 16,384 sequences. The field named is the one
        # that alone goes over: the prompts where they do at n = 1, else n.
        raise APIError(
            400,
            f"{len(job.prompts)} prompt(s) x n={job.params.n} = {job.sequences} sequences; this server takes at "
            f"most {max_request_seqs} in one request (kvlab serve --max-request-seqs)",
            "prompt" if len(job.prompts) > max_request_seqs else "n",
        )


def cache_salt(policy: TenancyPolicy, tenant: str, headers: Sequence[str], body_salt: str | None) -> str | None:
    """The engine's salt: derived from the tenant; a client salt (``headers``: the X-Cache-Salt values, or
    the body's ``cache_salt``) only narrows sharing inside it."""
    if len(headers) > 1:
        # A proxy that appends its own header would otherwise leave the client's first one in charge.
        raise APIError(400, "the X-Cache-Salt header is given more than once", "cache_salt")
    client_salt = None
    if headers:
        if not policy.trust_salt_header:
            raise APIError(
                400,
                "this server does not accept X-Cache-Salt (it is for a trusted proxy: --trust-salt-header); "
                "send 'cache_salt' in the body",
                "cache_salt",
            )
        client_salt = validate_salt(headers[0], "the X-Cache-Salt header")
    elif body_salt is not None:
        client_salt = validate_salt(body_salt, "'cache_salt'")
    return policy.cache_salt(tenant, client_salt)
