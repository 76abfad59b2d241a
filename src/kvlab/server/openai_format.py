"""Engine outputs -> OpenAI's response shapes (the models of ``schemas``): whole answers, streamed chunks, usage
and log-probabilities.

Log-probabilities come from the engine in vLLM's shape (per token, ``{token_id: Logprob(logprob, rank,
decoded_token)}``: the top-k plus the sampled token). Completions get OpenAI's legacy shape (``tokens``,
``token_logprobs``, ``top_logprobs`` as ``{token: logprob}`` with the sampled token included, as vLLM does,
``text_offset``); chat gets ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [k entries]}]}``.
A text offset is the sum of the lengths of the token strings before it, as in vLLM: where one character is
split over several tokens the strings do not add up to the text exactly.

vLLM's ``return_token_ids`` puts the prompt's token ids where vLLM 0.32 does: a completion choice's
``prompt_token_ids`` (in a stream, the choice's first chunk), a chat answer's top-level ``prompt_token_ids``
(in a stream, the first chunk, the role's); and in a stream each chunk's generated ids in
``choices[].token_ids`` (a whole answer always has them). Without it, none of these is sent but the whole
answer's ``choices[].token_ids``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlab.engine.request import CompletionOutput, RequestOutput
from kvlab.engine.sampling import Logprob
from kvlab.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)

# vLLM's floor: -inf (a token masked by min_tokens or a bias of -100 that underflowed) is no JSON number.
LOGPROB_FLOOR = -9999.0
Step = Mapping[int, Logprob] | None


def _finite(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


class Formatter:
    """Builds responses for one server: its model name, tokenizer and cached-tokens reporting."""

    def __init__(self, model_name: str, tokenizer: Any, report_cached: Callable[[int], int | None]) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.report_cached = report_cached

    # ------------------------------------------------------------------------------------- pieces
    def token_text(self, tid: int, step: Step) -> str:
        own = step.get(tid) if step is not None else None
        if own is not None and own.decoded_token is not None:
            return own.decoded_token
        return str(self.tokenizer.decode([tid]))

    def token_bytes(self, tid: int, text: str) -> list[int]:
        # kvlab's byte tokenizer: the token is a byte (its text alone may be U+FFFD, half a character).
        num_bytes = getattr(self.tokenizer, "NUM_BYTES", None)
        if num_bytes is not None:
            return [tid] if 0 <= tid < num_bytes else []
        return list(text.encode("utf-8"))

    def usage(self, outs: Sequence[RequestOutput]) -> Usage:
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        cached = self.report_cached(sum(o.num_cached_tokens for o in outs))
        details = None if cached is None else PromptTokensDetails(cached_tokens=cached)
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=details,
        )

    def completion_logprobs(self, ids: Sequence[int], steps: Sequence[Step], offset: int) -> CompletionLogprobs:
        """OpenAI's legacy shape for ``ids`` (``steps`` aligned with them; a None step, the first prompt token's,
        has no log-probability), text offsets counted from ``offset``."""
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for tid, step in zip(ids, steps, strict=True):
            text = self.token_text(tid, step)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            own = step.get(tid) if step is not None else None
            out.token_logprobs.append(None if own is None else _finite(own.logprob))
            if step is None:
                out.top_logprobs.append(None)
            else:
                out.top_logprobs.append(self._top_dict(step))
        return out

    def _top_dict(self, step: Mapping[int, Logprob]) -> dict[str, float]:
        """``{token text: logprob}``. Keyed by text, tokens can collide (every lone byte of a multi-byte
        character reads U+FFFD): the more likely one keeps the key, so the dict's best is the step's best."""
        top: dict[str, float] = {}
        for t, lp in sorted(step.items(), key=lambda item: item[1].rank):
            top.setdefault(self.token_text(t, step), _finite(lp.logprob))
        return top

    def chat_logprobs(self, ids: Sequence[int], steps: Sequence[Mapping[int, Logprob]], k: int) -> ChatLogprobs:
        content = []
        for tid, step in zip(ids, steps, strict=True):
            text = self.token_text(tid, step)
            best = sorted(step.items(), key=lambda item: item[1].rank)[:k]
            top = [self._top(t, lp, step) for t, lp in best]
            own = _finite(step[tid].logprob)
            content.append(TokenLogprob(token=text, logprob=own, bytes=self.token_bytes(tid, text), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _top(self, tid: int, lp: Logprob, step: Mapping[int, Logprob]) -> TopLogprob:
        text = self.token_text(tid, step)
        return TopLogprob(token=text, logprob=_finite(lp.logprob), bytes=self.token_bytes(tid, text))

    def echo_text(self, prompt: str | Sequence[int]) -> str:
        return prompt if isinstance(prompt, str) else str(self.tokenizer.decode(list(prompt)))

    def prompt_logprobs(self, out: RequestOutput) -> CompletionLogprobs:
        ids = out.prompt_token_ids
        steps: Sequence[Step] = out.prompt_logprobs or [None] * len(ids)
        return self.completion_logprobs(ids, steps, 0)

    # ------------------------------------------------------------------------------------- whole answers
    def completion(
        self, public_id: str, created: int, outs: Sequence[RequestOutput], prompts: Sequence[str | Sequence[int]],
        echo: bool, logprobs: bool, return_token_ids: bool = False,
    ) -> CompletionResponse:  # fmt: skip
        """One choice per (prompt, n): prompt i's choices have indices i*n .. i*n+n-1, as OpenAI numbers them;
        with ``return_token_ids`` each has its prompt's token ids."""
        choices = []
        for i, (out, prompt) in enumerate(zip(outs, prompts, strict=True)):
            head = self.echo_text(prompt) if echo else ""
            for c in out.outputs:
                lp = None
                if logprobs:
                    lp = self._choice_logprobs(out, c, echo, len(head))
                choices.append(
                    CompletionChoice(
                        index=i * len(out.outputs) + c.index,
                        text=head + c.text,
                        logprobs=lp,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        token_ids=c.token_ids,
                        prompt_token_ids=list(out.prompt_token_ids) if return_token_ids else None,
                    )
                )
        return CompletionResponse(
            id=public_id, created=created, model=self.model_name, choices=choices, usage=self.usage(outs)
        )

    def _choice_logprobs(self, out: RequestOutput, c: CompletionOutput, echo: bool, offset: int) -> CompletionLogprobs:
        own = self.completion_logprobs(c.token_ids, c.logprobs or [None] * len(c.token_ids), offset)
        if not echo:
            return own
        return _joined(self.prompt_logprobs(out), own)

    def chat(
        self, public_id: str, created: int, out: RequestOutput, top_logprobs: int | None, return_token_ids: bool = False
    ) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content=c.text),
                logprobs=None
                if top_logprobs is None
                else self.chat_logprobs(c.token_ids, c.logprobs or [], top_logprobs),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                token_ids=c.token_ids,
            )
            for c in out.outputs
        ]
        return ChatCompletionResponse(
            id=public_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=self.usage([out]),
            prompt_token_ids=list(out.prompt_token_ids) if return_token_ids else None,
        )


# ------------------------------------------------------------------------------------------------ streams
@dataclass
class ChoiceStream:
    """What one choice of a stream has sent: text, tokens (their log-probabilities went with the text) and
    the text offset of the next token."""

    holdback: int
    text: str = ""
    tokens: int = 0
    offset: int = 0
    started: bool = False
    closed: bool = False

    def visible(self, c: CompletionOutput) -> str:
        """The part of ``c.text`` that is final. A multi-byte character may be split across tokens: its
        incomplete tail decodes to one U+FFFD that may still become a real character, so one is held back
        (only one: the earlier ones are final, and a model may well emit invalid bytes for ever). And a stop
        string may be on its way: the last ``holdback`` characters (the longest stop string less one) may be
        its beginning, which must never be sent."""
        if c.finish_reason is not None:
            return c.text
        text = c.text[:-1] if c.text.endswith("\ufffd") else c.text
        return text[: max(len(self.text), len(text) - self.holdback)]


@dataclass
class StreamFormatter:
    """The chunks of one streamed answer, choice by choice."""

    fmt: Formatter
    public_id: str
    created: int
    chat: bool
    n: int
    holdback: int
    echo: bool = False
    logprobs: int | None = None  # completions: logprobs; chat: top_logprobs (None: not asked for)
    prompts: Sequence[str | Sequence[int]] = ()
    return_token_ids: bool = False  # vLLM's: prompt ids in each choice's first chunk, every chunk's own ids
    choices: dict[int, ChoiceStream] = field(default_factory=dict)

    def role_chunks(self, prompt_token_ids: Sequence[int] | None = None) -> list[ChatCompletionChunk]:
        """The first chunk of each choice, with its role; with ``return_token_ids`` the prompt's token ids."""
        chunks = [self._chat_chunk(i, ChatDelta(role="assistant"), None, None) for i in range(self.n)]
        if self.return_token_ids and prompt_token_ids is not None:
            for chunk in chunks:
                chunk.prompt_token_ids = list(prompt_token_ids)
        return chunks

    def updates(self, out: RequestOutput, prompt_index: int) -> list[CompletionResponse | ChatCompletionChunk]:
        """A chunk per choice of ``out`` with new final text, or that just finished."""
        chunks: list[CompletionResponse | ChatCompletionChunk] = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            state = self.choices.setdefault(index, ChoiceStream(self.holdback))
            if state.closed:
                continue
            text = state.visible(c)
            delta = text[len(state.text) :]  # what was sent is final, so it is a prefix of text
            if not delta and c.finish_reason is None:
                continue
            chunks.append(self._chunk(out, c, index, state, delta, prompt_index))
            state.text, state.tokens, state.started = text, len(c.token_ids), True
            state.closed = c.finish_reason is not None
        return chunks

    def _chunk(
        self, out: RequestOutput, c: CompletionOutput, index: int, state: ChoiceStream, delta: str, prompt_index: int
    ) -> CompletionResponse | ChatCompletionChunk:
        ids, steps = c.token_ids[state.tokens :], (c.logprobs or [])[state.tokens :]
        own_ids = ids if self.return_token_ids else None  # the slice is already this chunk's own list
        if self.chat:
            lp = None if self.logprobs is None else self.fmt.chat_logprobs(ids, steps, self.logprobs)
            return self._chat_chunk(index, ChatDelta(content=delta), lp, c.finish_reason, own_ids)
        head, head_lp = "", None
        if self.echo and not state.started:
            head = self.fmt.echo_text(self.prompts[prompt_index])
            if self.logprobs is not None:
                head_lp = self.fmt.prompt_logprobs(out)
                state.offset = len(head)
        completion_lp = None
        if self.logprobs is not None:
            completion_lp = self.fmt.completion_logprobs(ids, steps or [None] * len(ids), state.offset)
            state.offset += sum(len(t) for t in completion_lp.tokens)
            if head_lp is not None:
                completion_lp = _joined(head_lp, completion_lp)
        first = self.return_token_ids and not state.started
        choice = CompletionChoice(
            index=index, text=head + delta, logprobs=completion_lp, finish_reason=c.finish_reason,
            stop_reason=c.stop_reason, token_ids=own_ids,
            prompt_token_ids=list(out.prompt_token_ids) if first else None,
        )  # fmt: skip
        return CompletionResponse(id=self.public_id, created=self.created, model=self.fmt.model_name, choices=[choice])

    def _chat_chunk(
        self,
        index: int,
        delta: ChatDelta,
        logprobs: ChatLogprobs | None,
        reason: str | None,
        token_ids: list[int] | None = None,
    ) -> ChatCompletionChunk:
        choice = ChatStreamChoice(
            index=index, delta=delta, logprobs=logprobs, finish_reason=reason, token_ids=token_ids
        )
        return ChatCompletionChunk(id=self.public_id, created=self.created, model=self.fmt.model_name, choices=[choice])

    def usage_chunk(self, outs: Sequence[RequestOutput]) -> CompletionResponse | ChatCompletionChunk:
        """``stream_options.include_usage``: the last chunk, with no choices and the whole answer's usage."""
        usage = self.fmt.usage(outs)
        if self.chat:
            return ChatCompletionChunk(
                id=self.public_id, created=self.created, model=self.fmt.model_name, choices=[], usage=usage
            )
        return CompletionResponse(
            id=self.public_id, created=self.created, model=self.fmt.model_name, choices=[], usage=usage
        )


def _joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )
