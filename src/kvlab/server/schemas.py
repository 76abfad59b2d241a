"""The request and response bodies of the OpenAI-compatible API, as pydantic models (they are also what
``/openapi.json`` and ``/docs`` show).

Requests are validated strictly: ``"max_tokens": "5"`` or ``"stream": "yes"`` is a client bug, not a value to
coerce; numbers no float can hold, NaN and infinities are refused; an integer field never takes a boolean.
No field is silently ignored: an unknown one is a 400 naming it (``extra="forbid"``), with two exceptions,
both explicit tables below: fields that OpenAI SDKs and frameworks send and that change nothing about the
answer (``user``, ``store``, ...) are accepted and logged once by the server (``IGNORED_FIELDS``), and
fields kvlab does not implement are dropped only when their value asks for exactly what kvlab does anyway
(``"best_of": 1``, ``"tools": []``, ``"response_format": {"type": "text"}``: ``NOOP_VALUES``).

The routes read and size-check the body themselves (see ``guards.read_body``), then validate it here.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, cast, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvlab.engine.sampling import MAX_LOGPROBS

# The roles a chat message may have (OpenAI's, plus "developer"); anything else, template markup such as
# "<|im_start|>" smuggled into a role included, is refused.
ChatRole = Literal["system", "user", "assistant", "tool", "developer"]
CHAT_ROLES = frozenset(get_args(ChatRole))
# A bound for integers that have no natural one: JSON integers are unbounded, and 10**400 must be a 400.
I32_MAX = 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # a stream holds back as many characters as the longest stop string, less one

# Accepted and logged once (by the server): OpenAI's SDKs and common frameworks send these, and none changes
# what kvlab generates (end-user ids, storage and billing hints).
# Bounds on what one request may ask the sampler to do (its own cost, never another's).
MAX_ALLOWED_IDS = 65536
MAX_BAD_WORDS = 64
IGNORED_FIELDS = frozenset({"user", "store", "metadata", "service_tier", "safety_identifier"})
# Fields kvlab does not implement, dropped only when their value asks for what kvlab does anyway; any other
# value is refused as unsupported. ("best_of" equal to "n" is a no-op too: see RequestBase.)
NOOP_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, False, True),  # without tools there is nothing to call, in parallel or not
    "response_format": (None, {"type": "text"}),
}
# For the 400 that refuses one of them: "'best_of' is not supported by kvlab (only as null or 1 or n)".
UNSUPPORTED_HINTS = {
    k: " (only as " + " or ".join(json.dumps(v) for v in vs) + (" or n" if k == "best_of" else "") + ")"
    for k, vs in NOOP_VALUES.items()
}
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _union(message: str) -> Any:
    """A wrap validator that replaces pydantic's per-branch errors for a union (one per branch, with loc
    entries such as ``list[int]``) by one message a client can act on."""

    def wrap(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_union", message) from None

    return WrapValidator(wrap)


PromptInput = Annotated[
    str | list[str] | list[int] | list[list[int]],
    _union("must be a string, a list of strings, a list of token ids, or a list of lists of token ids"),
]
StopInput = Annotated[str | list[str], _union("must be a string or a list of strings")]


# ------------------------------------------------------------------------------------------------ requests
class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


def _content(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    if isinstance(value, list):
        for j, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise PydanticCustomError(
                    "content_part",
                    "part {j} is of type {kind}; kvlab's models read text only (parts of type 'text')",
                    {"j": j, "kind": repr(kind)[:40]},
                )
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError("content", "must be a string or a list of parts of type 'text'") from None


class ChatMessage(BaseModel):
    model_config = STRICT
    role: ChatRole
    content: Annotated[str | list[TextPart], WrapValidator(_content)]

    def text(self) -> str:
        """The content as one string; text parts are joined by newlines (as vLLM joins them)."""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class RequestBase(BaseModel):
    model_config = STRICT
    user: str | None = Field(default=None, description="Accepted and ignored (logged once)")
    store: bool | None = Field(default=None, description="Accepted and ignored (logged once)")
    metadata: dict[str, str] | None = Field(default=None, description="Accepted and ignored (logged once)")
    service_tier: str | None = Field(default=None, description="Accepted and ignored (logged once)")
    safety_identifier: str | None = Field(default=None, description="Accepted and ignored (logged once)")

    @model_validator(mode="before")
    @classmethod
    def _drop_noops(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        n = data.get("n", 1)

        def noop(key: str, value: Any) -> bool:
            if key == "best_of" and value == n and type(value) is int:
                return True
            return key not in cls.model_fields and key in NOOP_VALUES and _same(value, NOOP_VALUES[key])

        return {k: v for k, v in data.items() if not noop(k, v)}

    def ignored_fields(self) -> list[str]:
        """The accepted-but-ignored fields this request set (for the server's one log line per field)."""
        return sorted(IGNORED_FIELDS & self.model_fields_set)


def _same(value: Any, allowed: tuple[Any, ...]) -> bool:
    # == alone would take True for 1 and 1.0 for 1; a no-op must be the very value.
    return any(type(value) is type(a) and value == a for a in allowed)


class GenerateBase(RequestBase):
    """What both generation routes take."""

    model: str
    n: int = Field(default=1, ge=1, le=I32_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, description="Default 1; 0 is greedy")
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: StopInput | None = Field(default=None, description="Strings that end the answer; not included in it")
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(
        default=None, description="Token id (as a string) -> bias in [-100, 100]"
    )
    # vLLM's extensions.
    top_k: int | None = Field(default=None, ge=-1, le=I32_MAX, description="-1 or 0: off")
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0)
    min_tokens: int = Field(default=0, ge=0, le=I32_MAX)
    stop_token_ids: list[int] | None = Field(default=None, max_length=1024)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1, max_length=MAX_ALLOWED_IDS)
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    truncate_prompt_tokens: int | None = Field(default=None, ge=1, le=I32_MAX)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_token_ids: bool | None = Field(
        default=None,
        description="vLLM's: also the prompt's token ids (completions: choices[].prompt_token_ids; chat: "
        "prompt_token_ids; a stream: in each choice's first chunk) and, in a stream, each chunk's generated token "
        "ids (choices[].token_ids, which a whole answer always has)",
    )
    # kvlab's: narrows prefix-cache sharing inside the tenant (see docs/serving.md).
    cache_salt: str | None = None
    # kvlab's: this request's own first N prompt tokens are public, shared across tenants (server.public_prefixes).
    kvlab_public_prefix_tokens: int = Field(
        default=0,
        ge=0,
        le=I32_MAX,
        description="Mark the prompt's first N tokens public: their full KV blocks are shared with every tenant "
        "that sends the same tokens (at most the prompt's length; it never reaches another tenant's blocks)",
    )

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP_STRINGS or not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise PydanticCustomError(
                "stop", f"at most {MAX_STOP_STRINGS} strings of 1..{MAX_STOP_CHARS} characters each"
            )
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise PydanticCustomError("logit_bias", "keys must be token ids written as decimal strings")
            if not -100 <= bias <= 100:
                raise PydanticCustomError("logit_bias", "biases must be in [-100, 100]")
        return v

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _token_ids(cls, v: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if v is not None and not all(0 <= t <= I32_MAX for t in v):
            raise PydanticCustomError(str(info.field_name), "token ids must be in [0, 2**31)")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not all(0 < len(w) <= MAX_STOP_CHARS for w in v):
            raise PydanticCustomError("bad_words", f"words of 1..{MAX_STOP_CHARS} characters each")
        return v

    def bias(self) -> dict[int, float] | None:
        return None if self.logit_bias is None else {int(k): b for k, b in self.logit_bias.items()}


class CompletionRequest(GenerateBase):
    """``POST /v1/completions``."""

    prompt: PromptInput
    max_tokens: int | None = Field(default=None, ge=1, le=I32_MAX, description="Default 16")
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS, description="Top log-probabilities per token")
    echo: bool = Field(
        default=False, description="Prepend the prompt (with its log-probabilities when logprobs is set)"
    )

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and not isinstance(p[0], int):  # a list of strings or of token-id lists (validated as one kind)
            return list(cast("list[str | list[int]]", p))
        return [cast("list[int]", p)]  # token ids (an empty list too: the engine says why not)


class ChatCompletionRequest(GenerateBase):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=I32_MAX, description="Default: up to the context limit")
    max_completion_tokens: int | None = Field(default=None, ge=1, le=I32_MAX, description="OpenAI's newer max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS, description="Needs logprobs: true")


class TokenizeRequest(RequestBase):
    """``POST /tokenize`` (vLLM's): a prompt, or chat messages rendered by the model's template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(RequestBase):
    """``POST /detokenize`` (vLLM's)."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=I32_MAX)]]


# ----------------------------------------------------------------------------------------------- responses
class _Out(BaseModel):
    # Responses are built by the server, never parsed from clients: no strictness needed, and fields
    # excluded when None are the optional ones of OpenAI's shapes.
    model_config = ConfigDict(extra="forbid")


class ErrorBody(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Out):
    error: ErrorBody


class PromptTokensDetails(_Out):
    cached_tokens: int


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Absent with --report-cached-tokens off.
    prompt_tokens_details: PromptTokensDetails | None = Field(default=None, exclude_if=lambda v: v is None)


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended the answer
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)  # kvlab's: probes compare tokens
    # vLLM's, with return_token_ids (a stream: in the choice's first chunk only).
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(default=None, exclude_if=lambda v: v is None)


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[TokenLogprob] | None = None


class AssistantMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int]


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)  # return_token_ids


class ChatDelta(_Out):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=lambda v: v is None)
    content: str | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatStreamChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)  # return_token_ids: the delta's


class ChatCompletionChunk(_Out):
    """One server-sent event of a streamed chat answer; the last one (``stream_options.include_usage``) has
    no choices and the usage."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = Field(default=None, exclude_if=lambda v: v is None)
    # return_token_ids: on the first chunk of the stream (the role's), as vLLM sends it.
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvlab"
    max_model_len: int


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Out):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(_Out):
    prompt: str


class VersionResponse(_Out):
    version: str


class HealthResponse(_Out):
    status: str


# Request bodies are read by hand (see the module docstring), so FastAPI does not see them: the app adds their
# schemas to /openapi.json itself.
REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest,
    ChatCompletionRequest,
    TokenizeRequest,
    DetokenizeRequest,
)
