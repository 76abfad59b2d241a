"""Tokenizers: a byte-level UTF-8 tokenizer for the mini model, and a wrapper for real ones.

Both satisfy the ``Tokenizer`` protocol the engine uses.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, Protocol, overload

if TYPE_CHECKING:
    import tokenizers


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    stop_token_ids: tuple[int, ...]  # every id that ends generation: EOS and the model's end-of-turn ids

    # add_special_tokens: the BOS/EOS a tokenizer adds to a whole prompt; skip_special_tokens: leave their text
    # out (vLLM's default). A tokenizer without such tokens in its text takes both and changes nothing.
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...


class ByteTokenizer:
    """Token i < 256 is byte i of the UTF-8 encoding; specials follow. Round-trips any string."""

    NUM_BYTES = 256
    BOS, EOS, PAD = 256, 257, 258
    vocab_size = 259

    bos_token_id: int | None = BOS
    eos_token_id: int | None = EOS
    stop_token_ids: tuple[int, ...] = (EOS,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))  # it adds no BOS or EOS to a prompt

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # Special tokens have no bytes, so no text either way. A random model emits arbitrary byte sequences:
        # invalid UTF-8 shows as U+FFFD, never raises.
        return bytes(i for i in ids if 0 <= i < self.NUM_BYTES).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        # Content is not escaped, as Hugging Face's templates (and so vLLM) do not escape it: a "<|system|>"
        # typed into a message renders as it is. Whoever writes the messages could send that turn anyway;
        # text from a third party is for the caller to neutralise. Here the markers are plain bytes.
        parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
        return "".join(parts) + "<|assistant|>\n"


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` plus what the model around it knows: special tokens,
    whether BOS/EOS are added, the stop tokens and the chat template.

    Built by the GGUF loader from the file's metadata and by the HF-directory loader from
    ``tokenizer.json`` / ``tokenizer_config.json``; nothing here touches the network. Encoding and
    chat rendering follow ``transformers`` (the tests compare them): ``encode`` adds special tokens
    like ``tokenizer.encode`` does, and the chat template runs in the same sandboxed Jinja setup as
    ``apply_chat_template``.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        extra_stop_token_ids: Sequence[int] = (),
        model_vocab_size: int | None = None,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = {
            name: tok
            for name, tok in (
                ("bos_token", bos_token),
                ("eos_token", eos_token),
                ("unk_token", unk_token),
                ("pad_token", pad_token),
            )
            if tok is not None
        }
        for name, tok in self.special_tokens.items():
            if backend.token_to_id(tok) is None:
                raise ValueError(f"{name} {tok!r} is not in the tokenizer's vocabulary")
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token is not None else None
        self.eos_token_id: int | None = backend.token_to_id(eos_token) if eos_token is not None else None
        # None keeps the backend's own post-processor (tokenizer.json already says what it adds).
        if add_bos_token is not None or add_eos_token is not None:
            self._set_post_processor(bool(add_bos_token), bool(add_eos_token))
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        if model_vocab_size is not None and self.vocab_size > model_vocab_size:
            raise ValueError(
                f"the tokenizer has {self.vocab_size} tokens but the model's embedding only {model_vocab_size} rows"
            )
        stops = [self.eos_token_id] if self.eos_token_id is not None else []
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*stops, *extra_stop_token_ids]))
        self._compiled_template: Any = None

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        # The templates transformers' TokenizersBackend.update_post_processor builds (used for GGUF
        # vocabularies, which state add_bos/add_eos as flags rather than a post-processor).
        from tokenizers import processors

        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        if add_bos and bos is None:
            raise ValueError("the tokenizer should add a BOS token but none is defined")
        if add_eos and eos is None:
            raise ValueError("the tokenizer should add an EOS token but none is defined")

        def wrap(seq: str, type_id: int) -> list[str]:
            return [f"{bos}:{type_id}"] * add_bos + [f"{seq}:{type_id}"] + [f"{eos}:{type_id}"] * add_eos

        single = wrap("$A", 0)
        pair = single + wrap("$B", 1)
        specials = [
            (t, self.backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on and t is not None
        ]
        self.backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS/EOS are added when the model's tokenizer adds them (as HF's ``encode``).

        Text rendered by a chat template that already starts with BOS should pass
        ``add_special_tokens=False`` (HF's ``apply_chat_template(tokenize=True)`` does the same).
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # Skipping specials by default (as vLLM does) keeps a generated EOS such as <|im_end|> out of
        # the text.
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @overload
    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, tokenize: Literal[False] = False
    ) -> str: ...

    @overload
    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, *, tokenize: Literal[True]
    ) -> list[int]: ...

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, tokenize: bool = False
    ) -> str | list[int]:
        """Render ``messages`` with the model's own chat template, ending with the assistant's turn. The text
        by default (the ``Tokenizer`` protocol's answer; transformers' default is ``tokenize=True``); with
        ``tokenize=True`` its token ids, specials not added twice (as transformers does)."""
        if tokenize:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)
        if self.chat_template is None:
            raise ValueError("this model has no chat template; pass a plain prompt instead of chat messages")
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self.chat_template)
        return self._compiled_template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )


def _compile_chat_template(source: str) -> Any:
    """Compile a chat template in the environment transformers uses, so both render identically.

    Templates come with checkpoints and are untrusted code: the sandbox forbids attribute tricks.
    transformers' own renderer (``utils.chat_template_utils``) would put a ~0.5 s ``import transformers``
    in front of the first chat request, which real-model loading otherwise never pays.
    """
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError("chat templates need jinja2: pip install 'kvlab[models]'") from None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson HTML-escapes; chat templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
