"""Public prefixes on the server: the operator's file (parsed, rendered, tokenised, validated), the request
field (validated, never reaching another tenant), and what a second tenant sees: the public part cached,
nothing of the first tenant's private continuation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli_output import words
from kvlab.cli import app
from kvlab.server.public_prefixes import (
    PublicPrefixes,
    PublicPrefixFileError,
    PublicPrefixRequestError,
    load_public_prefixes,
    resolve_public_prefix,
)
from kvlab.tokenizer import ByteTokenizer

BS = 16  # the test servers' block size (the default)
# 70 bytes (one token each with the mini model's byte tokenizer): four full public blocks and 6 tokens more.
SYSTEM = "\u2603 Public system prompt shared by every tenant of this test server. "
SYSTEM_IDS = list(SYSTEM.encode())
PUBLIC = len(SYSTEM_IDS) // BS * BS  # what another tenant may find cached: whole public blocks only
SECRET = "Tenant a's private question: is the launch code still 7741? Answer briefly, please."
KEYS = {"key-a": "a", "key-b": "b"}
TOK = ByteTokenizer()


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# -- the file ------------------------------------------------------------------------------------------------
def test_yaml_and_jsonl_files_of_texts_and_chat_messages(tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "Be brief."}]
    yml = _write(
        tmp_path,
        "p.yaml",
        f"- {json.dumps(SYSTEM)}\n- text: {json.dumps(SYSTEM + 'More.')}\n- messages: {json.dumps(messages)}\n",
    )
    found = load_public_prefixes(yml, TOK, max_model_len=512, block_size=BS)
    chat = "<|system|>\nBe brief.\n<|user|>\n"  # the messages, then the header of the user turn that follows
    assert found.prefixes == (tuple(SYSTEM_IDS), tuple((SYSTEM + "More.").encode()), tuple(chat.encode()))
    # The longest declared prefix a prompt starts with; nothing for a prompt that starts with none.
    assert found.match(SYSTEM_IDS + list(b"More. And a question")) == len(SYSTEM_IDS) + 5
    assert found.match(SYSTEM_IDS + [1]) == len(SYSTEM_IDS)
    assert found.match(SYSTEM_IDS[:-1]) == 0 and found.match([]) == 0
    # A chat request that opens with those messages renders the prefix first (how the server renders it).
    conversation = TOK.apply_chat_template([*messages, {"role": "user", "content": "Hi"}])
    assert found.match(TOK.encode(conversation)) == len(chat)
    jsonl = _write(tmp_path, "p.jsonl", f"{json.dumps(SYSTEM)}\n\n{json.dumps({'messages': messages})}\n")
    assert load_public_prefixes(jsonl, TOK, 512, BS).prefixes == (tuple(SYSTEM_IDS), tuple(chat.encode()))


@pytest.mark.parametrize(
    ("name", "text", "error"),
    [
        ("p.txt", "hello", "YAML (.yaml, .yml) or JSON Lines"),
        ("p.yaml", "", "no public prefixes"),
        ("p.jsonl", "\n\n", "no public prefixes"),
        ("p.yaml", "- ''\n", "entry #1 is empty"),
        ("p.yaml", "- text: ''\n", "entry #1 is empty"),
        ("p.yaml", "- [unclosed\n", "line 2"),
        ("p.yaml", "text: hello\n", "must be a list of entries"),
        ("p.yaml", "- 42\n", "entry #1 must be a string"),
        ("p.yaml", "- {text: a, messages: []}\n", "entry #1 must be a string"),
        ("p.yaml", "- {txt: a}\n", "entry #1 must be a string"),
        ("p.yaml", "- text: [a]\n", "'text' must be a string"),
        ("p.yaml", "- messages: []\n", "non-empty list"),
        ("p.yaml", "- messages: [{role: wizard, content: hi}]\n", "entry #1: messages[0].role is not valid"),
        ("p.yaml", "- messages: [{role: system}]\n", "messages[0].content is not valid"),
        ("p.jsonl", '"ok"\n{"text": \n', "line 2, column"),
        ("p.jsonl", '"ok"\n7\n', "line 2 must be a string"),
        ("p.yaml", f"- {'x' * 600}\n", "has 600 tokens, more than max_model_len=512"),
        ("p.jsonl", '"ok"\n"a\\ud800b"\n', "line 2 is not valid Unicode text: it has a lone surrogate U+D800 at"),
        ("p.yaml", '- "ok \\udfff"\n', "entry #1 is not valid Unicode text: it has a lone surrogate U+DFFF"),
    ],
)
def test_a_bad_file_is_refused_naming_what_is_wrong(tmp_path: Path, name: str, text: str, error: str) -> None:
    with pytest.raises(PublicPrefixFileError, match="^" + str(tmp_path).replace("\\", "\\\\")) as info:
        load_public_prefixes(_write(tmp_path, name, text), TOK, max_model_len=512, block_size=BS)
    assert error in str(info.value)


def test_an_unreadable_file_and_a_template_that_refuses_are_errors_too(tmp_path: Path) -> None:
    with pytest.raises(PublicPrefixFileError, match="cannot be read"):
        load_public_prefixes(tmp_path / "missing.yaml", TOK, 512, BS)
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe- a\n")
    with pytest.raises(PublicPrefixFileError, match="cannot be read"):
        load_public_prefixes(tmp_path / "bin.yaml", TOK, 512, BS)

    class NoTemplate(ByteTokenizer):
        def apply_chat_template(self, messages):  # type: ignore[override]
            raise ValueError("this model has no chat template")

    path = _write(tmp_path, "m.yaml", "- messages: [{role: system, content: hi}]\n")
    with pytest.raises(PublicPrefixFileError, match="entry #1: the chat template cannot render.*no chat template"):
        load_public_prefixes(path, NoTemplate(), 512, BS)


def test_a_prefix_shorter_than_a_block_is_kept_with_a_warning(tmp_path: Path, caplog) -> None:
    found = load_public_prefixes(_write(tmp_path, "p.yaml", "- short\n"), TOK, 512, BS)
    assert found.prefixes == (tuple(b"short"),)
    assert "less than one KV block of 16: it can never be shared" in caplog.text


# -- the request field -----------------------------------------------------------------------------------------
def test_the_effective_public_prefix_is_the_larger_declaration() -> None:
    ids = SYSTEM_IDS + list(b"question")
    prefixes = PublicPrefixes((tuple(SYSTEM_IDS),))
    assert resolve_public_prefix(ids, 0, prefixes) == len(SYSTEM_IDS)
    assert resolve_public_prefix(ids, len(ids), prefixes) == len(ids)  # the client publishes its whole prompt
    assert resolve_public_prefix(ids, 3, None) == 3
    for bad in (len(ids) + 1, -1, True):
        with pytest.raises(PublicPrefixRequestError, match="kvlab_public_prefix_tokens") as info:
            resolve_public_prefix(ids, bad, prefixes)
        assert info.value.param == "kvlab_public_prefix_tokens"


# -- a live server -------------------------------------------------------------------------------------------
def _ask(http, key: str, prompt: str, **body) -> tuple[int, dict]:
    return http.post(
        "/v1/completions",
        {"model": "mini", "prompt": prompt, "max_tokens": 2, "temperature": 0, **body},
        {"Authorization": f"Bearer {key}"},
    )


def _cached(http, key: str, prompt: str, **body) -> int:
    status, answer = _ask(http, key, prompt, **body)
    assert status == 200, answer
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_operators_public_prefix_is_shared_across_tenants_and_nothing_private_is(tmp_path, make_server) -> None:
    path = _write(tmp_path, "public.yaml", f"- {json.dumps(SYSTEM)}\n")
    srv, http = make_server(api_keys=KEYS, report_cached_tokens="exact", public_prefix_file=path)
    assert _cached(http, "key-a", SYSTEM + SECRET) == 0
    # Tenant b sends tenant a's very prompt: only the public blocks are found, none of a's private text.
    assert _cached(http, "key-b", SYSTEM + SECRET) == PUBLIC
    # Nor does declaring a's text public itself reach a's private blocks: they are keyed under a's salt.
    assert _cached(http, "key-b", SYSTEM + SECRET[:40], kvlab_public_prefix_tokens=len(SYSTEM_IDS) + 40) == PUBLIC
    # Tenant a's own private continuation is still a's (the whole prompt but its last token).
    assert _cached(http, "key-a", SYSTEM + SECRET) == len(SYSTEM_IDS) + len(SECRET) - 1
    # A prompt that does not start with the declared prefix is private from its first token.
    assert _cached(http, "key-b", "x" + SYSTEM + SECRET) == 0
    assert srv.engine.stats().prefix_cache_hits_public >= 3 * PUBLIC
    # Per tenant, on /metrics (the operator's): hits in public blocks and in the tenant's own private ones.
    hits = {k: v for k, v in http.metrics().items() if k.startswith("prefix_cache_hits_by_tenant_total")}
    assert hits == {
        'prefix_cache_hits_by_tenant_total{blocks="private",tenant="a"}': len(SYSTEM_IDS) + len(SECRET) - 1 - PUBLIC,
        'prefix_cache_hits_by_tenant_total{blocks="public",tenant="a"}': PUBLIC,
        'prefix_cache_hits_by_tenant_total{blocks="private",tenant="b"}': 0,
        'prefix_cache_hits_by_tenant_total{blocks="public",tenant="b"}': 2 * PUBLIC,
    }


def test_a_prompt_two_tenants_sent_is_promoted_with_promote_after(make_server) -> None:
    """--promote-after 2: tenant c finds nothing of what a alone sent, but sending it makes two tenants: it is
    public from then on; the next request computes the public copy, and every tenant after it finds it."""
    keys = {"key-a": "a", "key-b": "b", "key-c": "c", "key-d": "d"}
    _, http = make_server(api_keys=keys, report_cached_tokens="exact", cache={"promote_after": 2})
    shared = SYSTEM + SECRET  # not declared public anywhere
    full = (len(shared.encode()) + 1) // BS * BS  # the whole blocks of the prompt (and its last token)
    assert _cached(http, "key-a", shared + "1") == 0
    assert _cached(http, "key-c", shared + "2") == 0  # one tenant computed it: nothing of a's is c's
    assert _cached(http, "key-b", shared + "3") == 0  # promoted after c: b computes the public copy
    assert _cached(http, "key-d", shared + "4") == full
    assert _cached(http, "key-a", shared + "6") == full


def test_chat_messages_of_the_file_are_shared_across_tenants(tmp_path, make_server) -> None:
    system = {"role": "system", "content": SYSTEM}
    path = _write(tmp_path, "public.jsonl", json.dumps({"messages": [system]}) + "\n")
    _, http = make_server(api_keys=KEYS, report_cached_tokens="exact", public_prefix_file=path)
    prefix = len(TOK.encode(f"<|system|>\n{SYSTEM}\n<|user|>\n"))

    def chat(key: str, question: str) -> int:
        body = {"model": "mini", "messages": [system, {"role": "user", "content": question}], "max_tokens": 1}
        status, answer = http.post("/v1/chat/completions", body, {"Authorization": f"Bearer {key}"})
        assert status == 200, answer
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert chat("key-a", SECRET) == 0
    assert chat("key-b", SECRET) == prefix // BS * BS


def test_the_request_field_publishes_the_senders_own_tokens_only(make_server) -> None:
    _, http = make_server(api_keys=KEYS, report_cached_tokens="exact")
    n = len(SYSTEM_IDS)
    assert _cached(http, "key-a", SYSTEM + SECRET, kvlab_public_prefix_tokens=n) == 0
    assert _cached(http, "key-b", SYSTEM + "other", kvlab_public_prefix_tokens=0) == 0  # b declared nothing
    assert _cached(http, "key-b", SYSTEM + "other", kvlab_public_prefix_tokens=n) == PUBLIC
    assert _cached(http, "key-b", SYSTEM + SECRET, kvlab_public_prefix_tokens=n + len(SECRET)) == PUBLIC


@pytest.mark.parametrize("value", [10_000, -1, True, "16", None, 1.5])
def test_the_request_field_is_validated(make_server, value) -> None:
    _, http = make_server(api_keys=KEYS)
    status, answer = _ask(http, "key-a", SYSTEM, kvlab_public_prefix_tokens=value)
    assert status == 400, answer
    assert answer["error"]["param"] == "kvlab_public_prefix_tokens", answer


def test_serve_refuses_a_bad_public_prefix_file(tmp_path: Path) -> None:
    runner = CliRunner()
    bad = _write(tmp_path, "p.yaml", "- ''\n")
    res = runner.invoke(app, ["serve", "mini", "--port", "0", "--public-prefix-file", str(bad)])
    assert res.exit_code == 2 and "entry #1 is empty" in words(res.output), res.output
    surrogate = _write(tmp_path, "s.jsonl", '"fine"\n{"text": "\\ud800"}\n')
    res = runner.invoke(app, ["serve", "mini", "--port", "0", "--public-prefix-file", str(surrogate)])
    said = words(res.output).replace(" ", "")  # the path may wrap anywhere in the panel
    assert res.exit_code == 2 and "s.jsonl:line2isnotvalidUnicodetext:ithasalonesurrogateU+D800" in said, said
    res = runner.invoke(app, ["serve", "mini", "--port", "0", "--public-prefix-file", str(tmp_path / "none.yaml")])
    assert res.exit_code == 2 and "does not exist" in res.output, res.output


def _guesses(client, key_of: dict[str, str], tenant: str, prompt: str, salts: list[str]) -> list[int]:
    """``tenant`` sends ``prompt`` once under each salt through the official client; the cached tokens it reads."""
    import openai

    c = openai.OpenAI(base_url=client.base_url + "/v1", api_key=key_of[tenant], timeout=60, max_retries=0)
    seen = []
    for salt in salts:
        out = c.completions.create(model="mini", prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt})
        seen.append(out.usage.prompt_tokens_details.cached_tokens)
    return seen


def test_one_key_under_many_salts_learns_nothing_with_promote_after(make_server) -> None:
    """Defect (promotion counted salts): with --promote-after 3, bob (one key) sending a guess under salts s1,
    s2, s1 read [0, 0, 0] when alice had sent it and [0, 0, 128] when not. Salts of one tenant are one party,
    so the right and the wrong guess read the same; a second key (K - 1 = 2 tenants) is what it takes."""
    keys = {"ka": "alice", "kb": "bob", "kc": "carol"}
    srv, _ = make_server(api_keys=keys, cache={"promote_after": 3})  # the default: block reporting
    key_of = {tenant: key for key, tenant in keys.items()}
    right = "alice private memo: " + "x" * 120
    wrong = "alice privatE memo: " + "x" * 120  # same length, differs in the first block
    _guesses(srv, key_of, "alice", right, ["a"])
    seen_right = _guesses(srv, key_of, "bob", right, ["s1", "s2", "s1"])
    seen_wrong = _guesses(srv, key_of, "bob", wrong, ["s1", "s2", "s1"])
    assert seen_right == seen_wrong == [0, 0, 128]  # bob's own s1 copy, whole blocks
    # The control: carol's key makes bob + carol + alice three tenants; the right guess is promoted at carol's
    # send, so carol's next send is keyed public and misses her own copy, which a wrong guess does not.
    assert _guesses(srv, key_of, "carol", right, ["c", "c"]) == [0, 0]
    assert _guesses(srv, key_of, "carol", wrong, ["c", "c"]) == [0, 128]
