"""Record the ``vllm:`` series of a live vLLM server: name, type, label names, histogram buckets.

    .venv/bin/python scripts/peers/record_vllm_metrics.py            # starts scripts/peers/vllm-serve.sh itself
    .venv/bin/python scripts/peers/record_vllm_metrics.py --base-url http://127.0.0.1:8001   # a running one

Starts vLLM on 127.0.0.1 (a free port) unless given a server, sends a few completions and chat completions
(streaming and not, n=2, a stop string, logprobs, a repeated prompt for prefix-cache hits), scrapes
``/metrics`` and writes ``tests/server/vllm_metrics_<version>.json`` (the digest ``tests/server/
test_metrics.py`` holds kvlab's names against: every ``vllm:`` family but prometheus_client's
``*_created`` gauges, which are listed apart) and ``.txt`` (the scrape's ``vllm:`` lines). Standard library plus
``prometheus_client``'s parser: runs in kvlab's venv or vLLM's. The server it started is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvlab.server.metrics import FamilyShape

REPO = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 2048  # the served max_model_len: vLLM's token-count buckets are capped by it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(base: str, path: str, body: dict[str, Any]) -> bytes:
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return bytes(r.read())
    except urllib.error.HTTPError as e:
        raise SystemExit(f"POST {path} {body}: {e.code} {e.read().decode()[:500]}") from None


def get(base: str, path: str, timeout: float = 30) -> bytes:
    with urllib.request.urlopen(base + path, timeout=timeout) as r:
        return bytes(r.read())


def wait_healthy(base: str, proc: subprocess.Popen[bytes] | None, limit: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode} before answering /health")
        try:
            get(base, "/health", timeout=5)
            return
        except OSError:
            time.sleep(2)
    raise SystemExit(f"no answer from {base}/health within {limit:.0f} s")


def traffic(base: str, model: str) -> None:
    """A few requests of every kind a dashboard's series count."""
    prompt = "The capital of France is"
    post(base, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    post(base, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                                   "logprobs": 2})  # fmt: skip
    post(base, "/v1/completions", {"model": model, "prompt": "Count: one, two,", "max_tokens": 16,
                                   "temperature": 0.8, "seed": 1, "stop": ["four"], "n": 2})  # fmt: skip
    # (n > 1 with temperature 0 is refused by vLLM: "n must be 1 when using greedy sampling")
    post(base, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                                   "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip
    chat = [{"role": "user", "content": "Name three colours."}]
    post(base, "/v1/chat/completions", {"model": model, "messages": chat, "max_tokens": 16, "temperature": 0})
    post(base, "/v1/chat/completions", {"model": model, "messages": chat, "max_tokens": 16, "temperature": 0,
                                        "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip
    post(base, "/v1/chat/completions", {"model": model, "messages": chat, "max_tokens": 16, "temperature": 0})


def digest(text: str, prefix: str = "vllm:") -> dict[str, Any]:
    """Every family named ``prefix*``: type, label names, buckets, and the values of the fixed-set labels."""
    series: dict[str, Any] = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith(prefix) or fam.name.endswith("_created"):
            continue  # prometheus_client's creation-time gauges: listed apart (created_series)
        shape = FamilyShape.of(fam)
        entry: dict[str, Any] = {
            "type": fam.type,
            "labels": shape.labels,
            "help": fam.documentation,
            "samples": sorted({s.name[len(fam.name) :] for s in fam.samples}),
        }
        if fam.type == "histogram":
            entry["buckets"] = shape.buckets
        if shape.label_values:
            entry["label_values"] = shape.label_values
        series[fam.name] = entry
    return dict(sorted(series.items()))


def created_series(text: str) -> list[str]:
    """The ``*_created`` families of the scrape (prometheus_client writes one per counter and histogram)."""
    return sorted(f.name for f in text_string_to_metric_families(text) if f.name.endswith("_created"))


def write(text: str, version: str, out: Path) -> Path:
    series = digest(text)
    stem = out / f"vllm_metrics_{'.'.join(version.split('.')[:2])}"
    record = {
        "vllm_version": version,
        "recorded_with": "scripts/peers/record_vllm_metrics.py (vllm-serve.sh float32, prefix caching on)",
        "max_model_len": MAX_MODEL_LEN,
        "created_series": created_series(text),
        "series": series,
    }
    Path(f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    Path(f"{stem}.txt").write_text("".join(line + "\n" for line in text.splitlines() if "vllm:" in line))
    print(f"{len(series)} vllm: series -> {stem}.json, .txt", file=sys.stderr)
    return stem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", help="a running vLLM server (default: start one with vllm-serve.sh)")
    ap.add_argument("--from-text", metavar="FILE", help="digest a saved scrape (the .txt this writes) again")
    ap.add_argument("--version", default="0.32.0", help="with --from-text: the vLLM version it came from")
    ap.add_argument("--model", default="smollm2", help="the served model name")
    ap.add_argument("--out-dir", default=str(REPO / "tests" / "server"))
    ap.add_argument("--startup-limit", type=float, default=600)
    args = ap.parse_args()
    if args.from_text:
        write(Path(args.from_text).read_text(), args.version, Path(args.out_dir))
        return
    proc = None
    base = args.base_url
    t0 = time.monotonic()
    if base is None:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        env = {**os.environ, "KVLAB_VLLM_MAX_MODEL_LEN": str(MAX_MODEL_LEN)}
        log = tempfile.NamedTemporaryFile(prefix="vllm-serve-", suffix=".log", delete=False)  # noqa: SIM115
        proc = subprocess.Popen(
            ["bash", str(REPO / "scripts/peers/vllm-serve.sh"), "float32", str(port)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
        print(f"started vLLM (pid {proc.pid}) on {base}; log in {log.name}", file=sys.stderr)
    try:
        wait_healthy(base, proc, args.startup_limit)
        started = time.monotonic() - t0
        version = json.loads(get(base, "/version"))["version"]
        traffic(base, args.model)
        time.sleep(1)  # the engine's stats reach the frontend's logger once per step
        text = get(base, "/metrics").decode()
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
    write(text, version, Path(args.out_dir))
    print(f"server up in {started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
