"""What the order of guesses costs the token strategy of ``kvlab probe --extract``, offline (no server).

The token strategy tries candidate tokens until one is the victim's; a step costs the rank of that token in
the order tried. This script replays the attack on SmolLM2's tokenizer, the victim's prompt known: for each
secret, the guesses each order needs until the last token of the secret (the final "end of the secret" sweep,
which every order pays alike, left out). Orders: the old one (longest text first), shortest first by id (the
tokenizer's merges), the random-string prior, the local model's prior (SmolLM2 itself, fp32), and their mean
(what the probe uses: ``kvlab.probe.attacks.priors``). Secrets: random strings of the default alphabet, and
natural-language ones spelled in it.

    .venv/bin/python scripts/extract_order.py [--random 12] [--seed 0]

Prints a markdown table (docs/probe.md holds the one of record). CPU-heavy for a minute or two: run it alone.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable

from kvlab.probe.attacks.base import DEFAULT_ALPHABET
from kvlab.probe.attacks.priors import ModelPrior, order_candidates, string_prior
from kvlab.probe.attacks.tokenizers import LocalTokenizer, TokenizerAccess, load_local_tokenizer
from kvlab.probe.attacks.tokens import consistent, stable_known

PREFIX = "[0123456789ab] Internal note for the assistant. The access code is: "
NATURAL = ("hiddenpalace", "openkingdom", "mediaplan", "goldenapple", "blackjack", "deadline")
MAX_SECRET = 12


def cost(
    tok: TokenizerAccess,
    vocab: dict[int, str],
    secret: str,
    order: Callable[[list[int], int, list[int]], list[int]],
) -> int:
    """Guesses until the secret's last token, trying candidates in ``order(known, covered, cands)``."""
    victim = tok.encode(PREFIX + secret) or []
    known = stable_known(tok, PREFIX, DEFAULT_ALPHABET) or []
    covered = sum(len(vocab.get(t, "")) for t in known)
    total = 0
    while len(known) < len(victim):
        cands = [t for t, text in vocab.items() if consistent(PREFIX, DEFAULT_ALPHABET, MAX_SECRET, covered, text)]
        ranked = order(known, covered, cands)
        target = victim[len(known)]
        total += ranked.index(target) + 1
        known.append(target)
        covered += len(vocab[target])
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random", type=int, default=12, help="random secrets (8 characters each)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    local: LocalTokenizer = load_local_tokenizer("smollm2")
    tok = TokenizerAccess(local=local)
    vocab = tok.vocabulary() or {}
    model = ModelPrior("smollm2")
    rng = random.Random(args.seed)
    secrets = ["".join(rng.choice(DEFAULT_ALPHABET) for _ in range(8)) for _ in range(args.random)]

    def strings(known: list[int], covered: int) -> dict[int, float]:
        spelled = "".join(vocab.get(t, "") for t in known) + PREFIX[covered:]
        done = max(0, covered - len(PREFIX))
        lengths = [n - done for n in range(8, MAX_SECRET + 1) if n > done] or [1]
        return string_prior(tok.encode_offline, known, spelled, DEFAULT_ALPHABET, lengths, random.Random(1))

    orders: dict[str, Callable[[list[int], int, list[int]], list[int]]] = {
        "longest first (before)": lambda k, c, cands: sorted(cands, key=lambda t: (-len(vocab[t]), t)),
        "shortest first, by id": lambda k, c, cands: order_candidates(cands, vocab, [], []),
        "random-string prior": lambda k, c, cands: order_candidates(cands, vocab, [], [strings(k, c)]),
        "local model prior": lambda k, c, cands: order_candidates(cands, vocab, [], [model(k, cands)]),
        "mean of both (the probe)": lambda k, c, cands: order_candidates(
            cands, vocab, [], [strings(k, c), model(k, cands)]
        ),
    }
    print(f"| order | {len(secrets)} random 8-character secrets: median / max guesses | natural: median / max |")
    print("|---|---|---|")
    for name, order in orders.items():
        r = [cost(tok, vocab, s, order) for s in secrets]
        n = [cost(tok, vocab, s, order) for s in NATURAL]
        print(f"| {name} | {statistics.median(r):,.0f} / {max(r):,} | {statistics.median(n):,.0f} / {max(n):,} |")
    print(f"\nnatural secrets: {', '.join(NATURAL)}; alphabet {DEFAULT_ALPHABET!r}")


if __name__ == "__main__":
    main()
