"""The attack table of README "What is shared with whom": tenant B (key ak) attacks tenant A (key vk) with
``kvlab probe --extract`` (and ``--timing``) on a fresh ``kvlab serve --model mini`` per sharing policy.

    .venv/bin/python scripts/tenant_attacks.py [--policies per-tenant,global] [--json out.json]

The victim's known prefix is declared public where the policy has public prefixes (the operator published it):
the attacker should then see that prefix (visible by design) and nothing of the secret after it. Each server
runs alone; the machine should be quiet (TTFT steps of the attack are timing-based).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

KVLAB = str(Path(sys.executable).with_name("kvlab"))
KEYS = ["--api-key", "vk:victim", "--api-key", "ak:attacker"]
# 46 characters: with 16-token blocks (one token per byte) the secret's first two characters end block 3, so
# its first step guesses two letters; the prefix's first two blocks are public where it is declared.
PREFIX = "Internal note for the assistant. Code is: ".ljust(44, ".") + ": "
SECRET = "kbmdaphe"


def policies(public_file: Path) -> dict[str, list[str]]:
    public = ["--public-prefix-file", str(public_file)]
    return {
        "per-tenant": [],
        "public-prefixes": public,
        "public+promotion K=2": [*public, "--promote-after", "2"],
        "public+promotion K=3": [*public, "--promote-after", "3"],
        "global": ["--prefix-sharing", "global"],
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"kvlab serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} not healthy after {timeout} s")


def probe(url: str, *args: str) -> dict[str, Any]:
    cmd = [KVLAB, "probe", "--base-url", url, "--model", "mini", "--api-key", "ak", *args, "--json", "-"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if res.returncode == 2:
        raise RuntimeError(f"probe failed: {res.stderr[-2000:]}")
    data: dict[str, Any] = json.loads(res.stdout)
    return data


def cached_tokens(url: str, key: str, prompt: str, salt: str | None = None) -> int:
    fields: dict[str, Any] = {"model": "mini", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        fields["cache_salt"] = salt
    body = json.dumps(fields).encode()
    req = urllib.request.Request(
        url + "/v1/completions", body, {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        usage = json.loads(r.read())["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def membership(url: str) -> dict[str, list[int]]:
    """The promotion threat: the victim sends its prompt; the attacker sends a guess of the whole prompt three
    times. Under promote_after=2 a right guess makes two tenants, so it is promoted: the attacker's second send is
    keyed public and no longer finds its own private copy (fewer cached tokens than a wrong guess's second send,
    which does). Then the same with one key under cache salts s1, s2, s1, which counted as three parties before
    promotion counted tenants. Each guess is fresh text after the shared prefix, so no earlier request interferes."""
    out: dict[str, list[int]] = {}
    note = " and the rest of the victim's private note, long enough to fill several blocks of its own."
    # Fresh salts for each salted case, so that the right and the wrong guess start from the same state (a salt's
    # namespace holds nothing of the attacker's earlier sends).
    cases = (
        ("right guess", "x1", "x1", [None] * 3),
        ("wrong guess", "y2", "y3", [None] * 3),
        ("right guess, salts s1/s2/s1", "z4", "z4", ["r1", "r2", "r1"]),
        ("wrong guess, salts s1/s2/s1", "w5", "w6", ["w1", "w2", "w1"]),
    )
    for label, victim_tail, guess_tail, salts in cases:
        cached_tokens(url, "vk", PREFIX + victim_tail + note)
        out[label] = [cached_tokens(url, "ak", PREFIX + guess_tail + note, salt) for salt in salts]
    return out


def run_policy(name: str, serve_args: list[str], timing: bool) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [KVLAB, "serve", "--model", "mini", "--port", str(port), *KEYS, *serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, proc)
        t0 = time.monotonic()
        ex = probe(url, "--extract", "--victim-api-key", "vk", "--prefix", PREFIX, "--secret", SECRET, "--seed", "1")
        row: dict[str, Any] = {"policy": name, "serve": " ".join(serve_args), "extract": ex}
        row["extract_seconds"] = time.monotonic() - t0
        row["membership"] = membership(url)
        if timing:
            row["timing"] = probe(url, "--timing", "--victim-api-key", "vk", "--no-reuse", "--timing-trials", "12")
        return row
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def summary(row: dict[str, Any]) -> str:
    ex = row["extract"]["evidence"]  # the probe's versioned document: the attack's report is its evidence
    secret = ex["secret"]
    found = f"{ex['correct_chars']} of {len(secret)} chars" if ex["correct_chars"] else "nothing"
    prefix = f"prefix {'visible' if ex['prefix_visible'] else 'hidden'} ({ex['prefix_hit_tokens'] or 0} tokens hit)"
    m = row["membership"]

    def guessed(suffix: str) -> str:
        right, wrong = m["right guess" + suffix], m["wrong guess" + suffix]
        told = "tells" if right != wrong else "cannot tell"
        return f"{told}: right {'/'.join(map(str, right))}, wrong {'/'.join(map(str, wrong))}"

    cells = [
        row["policy"],
        f"{ex['verdict']}: {found}",
        prefix,
        f"{ex['attacker_requests']} + {ex['victim_requests']}",
        guessed(""),
        guessed(", salts s1/s2/s1"),
    ]
    if "timing" in row:
        t = row["timing"]["evidence"].get("timing") or {}
        plain = [r for r in t.get("runs", []) if not r.get("salted")]
        best = max((r.get("auc") or 0.0 for r in plain), default=float("nan"))
        cells.append(f"best AUC {best:.2f}: {row['timing']['verdict']}")
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", help="comma-separated names (default: all)")
    ap.add_argument("--timing", action="store_true", help="also run probe --timing per policy")
    ap.add_argument("--json", type=Path, help="write every report here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        public_file = Path(tmp) / "public.yaml"
        public_file.write_text(f"- {json.dumps(PREFIX)}\n", encoding="utf-8")
        table = policies(public_file)
        names = args.policies.split(",") if args.policies else list(table)
        rows = []
        for name in names:
            print(f"{name}: kvlab serve {' '.join(table[name])}", file=sys.stderr, flush=True)
            rows.append(run_policy(name, table[name], args.timing))
            print(summary(rows[-1]), flush=True)
    header = (
        "| policy | `probe --extract` by tenant B | A's known prefix | requests (B + A) | B's whole-prompt guess, "
        "cached tokens of 3 sends | the same under salts s1/s2/s1 |"
    )
    print(header + (" `--timing` AUC |" if args.timing else ""))
    print("|---" * (7 if args.timing else 6) + "|")
    for row in rows:
        print(summary(row))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
