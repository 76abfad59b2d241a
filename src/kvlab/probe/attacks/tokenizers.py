"""The attacker's view of the server's tokenizer, shared by the token, dictionary and membership attacks of
``kvlab probe --extract``: in order, the server's ``/tokenize`` and ``/detokenize`` (llama.cpp, vLLM, kvlab);
a local copy (``--tokenizer`` or the served model's name: a kvlab preset, a GGUF file or a Hugging Face
directory, read without its weights), which also gives the vocabulary without one ``/detokenize`` per token.
Where both exist they must agree on a test text, or the local copy is dropped."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvlab.openai_http import token_ids_of
from kvlab.probe.attacks.base import FILLERS, Reply, tokens
from kvlab.probe.client import ProbeClient, ProbeError

MAX_VOCAB = 1 << 18  # ids the server's /detokenize is asked about at most (the largest vocabularies: 256k)
TEST_TEXT = "Probe: tokenizer check, 1234 abcd ABCD é."  # local and server tokenizers must agree on it


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int] | None: ...

    def decode(self, ids: Sequence[int]) -> str | None: ...


class ServerTokenizer:
    """The server's ``/tokenize`` (the body shape ``find_tokenizer`` found) and ``/detokenize``."""

    def __init__(self, client: ProbeClient) -> None:
        self.client = client
        self.requests = 0

    def encode(self, text: str) -> list[int] | None:
        self.requests += 1
        try:
            ids = self.client.tokenize(text)
        except ProbeError:
            return None
        return None if ids is None else list(ids)

    def encode_with_specials(self, text: str) -> list[int] | None:
        """``text`` tokenised as a text prompt is (llama.cpp's ``add_special``, vLLM's default), or None."""
        body = self.client.tokenize_body or {}
        shape = {"content": text, "add_special": True} if "content" in body else {"prompt": text}
        self.requests += 1
        try:
            data, _ = self.client.post("/tokenize", shape)
        except ProbeError:
            return None
        ids = token_ids_of(data.get("tokens"))
        return None if ids is None else list(ids)

    def decode(self, ids: Sequence[int]) -> str | None:
        """The text of ``ids`` (vLLM and kvlab answer ``prompt``, llama.cpp ``content``); None: refused."""
        self.requests += 1
        try:
            data, _ = self.client.post("/detokenize", {"tokens": list(ids)})
        except ProbeError:
            return None
        text = data.get("prompt", data.get("content"))
        return text if isinstance(text, str) else None

    def vocab_size(self, cap: int = MAX_VOCAB) -> int:
        """The first id ``/detokenize`` refuses (doubling, then bisecting), at most ``cap``."""
        lo, hi = 0, 1  # lo: known valid (id 0 is in any vocabulary); hi: first id not yet known valid
        while hi < cap and self.decode([hi]) is not None:
            lo, hi = hi, min(2 * hi, cap)
        if hi >= cap and self.decode([cap - 1]) is not None:
            return cap
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.decode([mid]) is not None else (lo, mid)
        return hi


class LocalTokenizer:
    """A local copy of the server's tokenizer (kvlab's ``Tokenizer``, or transformers')."""

    def __init__(self, tok: Any, name: str) -> None:
        self.tok, self.name = tok, name
        self.vocab_size = int(getattr(tok, "vocab_size", 0) or len(tok))

    def encode(self, text: str) -> list[int] | None:
        return [int(i) for i in self.tok.encode(text)]

    def decode(self, ids: Sequence[int]) -> str | None:
        return str(self.tok.decode(list(ids)))


def load_local_tokenizer(name: str) -> LocalTokenizer:
    """The tokenizer of a kvlab model name (mini presets, smollm2), a ``.gguf`` file or a Hugging Face
    directory, read without the weights; else transformers' ``AutoTokenizer`` of a local path. Raises
    ``ValueError`` saying why not."""
    from kvlab.model.mini import MINI_VARIANTS
    from kvlab.tokenizer import ByteTokenizer

    if name in MINI_VARIANTS:
        return LocalTokenizer(ByteTokenizer(), name)
    path: Path | None = None
    if name == "smollm2":
        from kvlab.model.gguf import smollm2_gguf_path
        from kvlab.model.weights import ModelLoadError

        try:
            path = smollm2_gguf_path()
        except ModelLoadError as exc:
            raise ValueError(str(exc)) from None
    else:
        path = Path(name).expanduser()
    if not path.exists():
        raise ValueError(f"no tokenizer for {name!r}: not a kvlab model name and no such file or directory")
    try:
        if path.is_file() and path.suffix == ".gguf":
            from kvlab.model.gguf import gguf_model_config, gguf_tokenizer, read_gguf
            from kvlab.model.gguf.reader import mapped

            with mapped(path) as buf:
                parsed = read_gguf(path, buf)
                return LocalTokenizer(gguf_tokenizer(parsed, gguf_model_config(parsed).vocab_size), name)
        if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
            import json

            from kvlab.model.hf_loader import hf_tokenizer

            hf = json.loads((path / "config.json").read_text(encoding="utf-8"))
            return LocalTokenizer(hf_tokenizer(path, hf, int(hf["vocab_size"])), name)
        from transformers import AutoTokenizer  # type: ignore[import-not-found,unused-ignore]

        return LocalTokenizer(AutoTokenizer.from_pretrained(str(path), local_files_only=True), name)
    except Exception as exc:  # any loader's failure: the attack carries on with the server's tokenizer
        raise ValueError(f"cannot load a tokenizer from {path}: {type(exc).__name__}: {exc}") from None


@dataclass
class TokenizerAccess:
    """The attacker's view of the server's tokenizer: ``encode`` by the server where it offers /tokenize
    (authoritative), else by the local copy; the vocabulary (id -> text) from the local copy, else the
    server's /detokenize id by id. ``notes``: what was chosen and dropped, for the report."""

    server: ServerTokenizer | None = None
    local: LocalTokenizer | None = None
    notes: list[str] = field(default_factory=list)
    # What the server puts before a text prompt's tokens (llama.cpp's and vLLM's BOS) where /tokenize leaves it
    # out: every encoding starts with it, so token-id prompts line up with the victim's text prompt.
    specials: list[int] = field(default_factory=list)
    specials_checked: bool = False
    line_up: tuple[int, Reply] | None = None  # (tokens of a text prompt, the reply to its token-id copy)
    _vocab: dict[int, str] | None = None
    _encoded: dict[str, list[int] | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.server is not None and self.local is not None:
            theirs, ours = self.server.encode(TEST_TEXT), self.local.encode(TEST_TEXT) or []
            # One side may add a BOS the other leaves out: the vocabulary is what must agree.
            if theirs is not None and theirs not in (ours, ours[1:]) and theirs[1:] != ours:
                self.notes.append(
                    f"the local tokenizer {self.local.name!r} disagrees with the server's /tokenize "
                    f"({ours} vs {theirs} for {TEST_TEXT!r}): not used"
                )
                self.local = None

    @property
    def available(self) -> bool:
        return self.server is not None or self.local is not None

    @property
    def requests(self) -> int:
        return 0 if self.server is None else self.server.requests

    @property
    def source(self) -> str:
        parts = []
        if self.server is not None:
            parts.append("the server's /tokenize")
        if self.local is not None:
            parts.append(f"a local copy ({self.local.name})")
        return " and ".join(parts)

    def encode(self, text: str) -> list[int] | None:
        """``text``'s tokens as the server sees a text prompt (``specials`` first)."""
        if text not in self._encoded:
            enc: TextTokenizer | None = self.server if self.server is not None else self.local
            self._encoded[text] = None if enc is None else enc.encode(text)
        ids = self._encoded[text]
        return None if ids is None else [*self.specials, *ids]

    def encode_offline(self, text: str) -> list[int] | None:
        """``encode`` by the local copy where there is one (it agreed with the server's; nothing is sent, nothing
        kept), else by the server."""
        if self.local is None:
            return self.encode(text)
        ids = self.local.encode(text)
        return None if ids is None else [*self.specials, *ids]

    def count(self, text: str) -> int | None:
        ids = self.encode(text)
        return None if ids is None else len(ids)

    def vocabulary(self) -> dict[int, str] | None:
        """Every id whose text is whole characters (no special tokens, no half a UTF-8 sequence). A token's
        text is read after an anchor token (``decode([a, t])`` minus ``decode([a])``), so a SentencePiece
        piece keeps the space a lone decode would strip."""
        if self._vocab is not None:
            return self._vocab
        dec: TextTokenizer | None
        if self.local is not None:
            dec, size = self.local, self.local.vocab_size
        elif self.server is not None:
            dec, size = self.server, self.server.vocab_size()
        else:
            return None
        anchor_ids = (self.encode("a") or [])[len(self.specials) :]
        if not anchor_ids:
            return None
        anchor = anchor_ids[-1]
        head = dec.decode([anchor]) or ""
        vocab: dict[int, str] = {}
        for tid in range(size):
            both = dec.decode([anchor, tid])
            if both is None or not both.startswith(head):
                continue
            text = both[len(head) :]
            if text and "\ufffd" not in text:
                vocab[tid] = text
        self._vocab = vocab
        return vocab


def byte_level(tokenizer: TokenizerAccess | None, alphabet: str, extra: str = "") -> bool:
    """Is the tokenizer one token a byte (so character lengths are token counts), judged on prose like the
    prompts', the alphabet and ``extra``? Unknown (no tokenizer): assumed, as the character strategy does."""
    if tokenizer is None or not tokenizer.available:
        return True
    text = f"Internal note for the assistant. The access code is: {alphabet}{alphabet[::-1]} {extra}"
    n = tokenizer.count(text)
    return n is None or n == tokens(text)


def filler_id(tokenizer: TokenizerAccess, alphabet: str, vocab: dict[int, str]) -> tuple[str, int] | None:
    """The first filler character outside the alphabet that is one token of its own."""
    for f in FILLERS:
        ids = tokenizer.encode(f)
        if f not in alphabet and ids is not None and len(ids) >= 1 and vocab.get(ids[-1]) == f:
            return f, ids[-1]
    return None
