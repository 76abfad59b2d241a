"""The strategies of ``kvlab probe --extract``, chosen from what the calibration measured about the server
(``--strategy`` forces one):

- ``char`` (``kvlab.probe.extract``): one character at a time, jointly up to the next reporting boundary, by
  cached_tokens, the /metrics counter or TTFT. Where characters are tokens (a byte-level tokenizer, the mini
  model), it is the token strategy without its vocabulary.
- ``token`` (``tokens``): one token at a time, in the server's own tokenisation, where hits are counted
  exactly per token and the tokenizer is not byte-level (llama.cpp with a BPE model).
- ``dictionary`` (``dictionary``): the whole secret at once from a candidate set, where hits show only in
  whole blocks (vLLM, kvlab's default block reporting) or when ``--dictionary`` says the secret is one of a
  list.
- ``membership`` (``membership``): is this exact prompt cached? With ``--candidates`` (whole prompts), or
  when forced: the victim's prompt among generated decoys, including the promotion-aware three sends.

``auto``: membership when ``--candidates`` is given, dictionary when ``--dictionary`` is; else char when the
calibration's counts follow characters; else, with the server's tokenizer, a calibration in token ids: token
when it counts exactly, dictionary when in blocks and the secret's candidates fit the request budget,
membership of the victim's exact prompt when they do not (the reason says what a whole recovery would cost);
else char (TTFT).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvlab.probe.attacks.base import COUNT_CHANNELS, STRATEGIES, validate_strategy_config

if TYPE_CHECKING:
    from kvlab.probe.attacks.tokenizers import TokenizerAccess
    from kvlab.probe.attacks.traffic import Attack


def choose(run: Attack, tokenizer: TokenizerAccess | None) -> tuple[str, str]:
    """(the strategy, why) for this server; may calibrate again in token ids (``tokens.calibrate_tokens``)."""
    from kvlab.probe.attacks.dictionary import candidate_count, whole_cost
    from kvlab.probe.attacks.tokens import byte_level, calibrate_tokens

    cfg, report = run.cfg, run.report
    if cfg.strategy != "auto":
        return cfg.strategy, "forced by --strategy"
    if cfg.candidates is not None:
        return "membership", f"--candidates gives {len(cfg.candidates)} whole prompts: is one of them cached?"
    if cfg.dictionary is not None:
        return "dictionary", f"--dictionary gives {len(cfg.dictionary)} candidates for the whole secret"
    bytes_ = byte_level(tokenizer, cfg.alphabet)
    if report.channel in COUNT_CHANNELS and bytes_:
        return "char", "the hit counts follow characters (one token a byte): a character guess is a token guess"
    reported = report.calibration.get("reported") or []
    countable = any(r for r in reported) or run.hit_counter is not None
    if tokenizer is None or not tokenizer.available or not countable or bytes_:
        return "char", "no count channel in characters or tokens: the character attack by TTFT"
    if not calibrate_tokens(run, tokenizer):
        return "char", "the calibration in token ids found no count channel: the character attack by TTFT"
    if report.granularity == 1:
        return "token", f"{report.channel} counts hits exactly per token of a tokenizer that is not byte-level"
    blocks = f"{report.channel} counts hits in blocks of {report.granularity} tokens"
    n = candidate_count(cfg)
    if n > run.budget_left():
        return "membership", (
            f"{blocks}, and the secret's {n:,} candidates are out of reach within --max-requests "
            f"{cfg.max_requests} (a whole recovery would cost {whole_cost(n)}): is the victim's exact prompt "
            "cached?"
        )
    return "dictionary", f"{blocks}: whole-secret guesses"


def run_strategy(run: Attack, tokenizer: TokenizerAccess | None) -> bool:
    """Choose and run the strategy; False when it is ``char`` (``extract`` runs that one itself)."""
    name, why = choose(run, tokenizer)
    run.report.strategy, run.report.strategy_reason = name, why
    if name == "char":
        return False
    if tokenizer is not None:
        run.report.notes.extend(n for n in tokenizer.notes if n not in run.report.notes)
    if name == "token":
        from kvlab.probe.attacks.tokens import run_token

        run_token(run, tokenizer)
    elif name == "dictionary":
        from kvlab.probe.attacks.dictionary import run_dictionary

        run_dictionary(run, tokenizer)
    else:
        from kvlab.probe.attacks.membership import run_membership

        run_membership(run, tokenizer)
    if tokenizer is not None:
        run.report.tokenizer = run.report.tokenizer or tokenizer.source
        run.report.tokenizer_requests = tokenizer.requests
    return True


__all__ = ["STRATEGIES", "choose", "run_strategy", "validate_strategy_config"]
