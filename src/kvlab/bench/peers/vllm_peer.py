"""vLLM as a throughput peer: ``vllm.LLM`` in vLLM's own interpreter (its venv, never kvlab's: see
``scripts/peers/vllm.sh``), driven from kvlab through a subprocess speaking JSON lines
(``vllm_worker.py``, run by path, so that interpreter needs no kvlab).

The worker is started once and kept: vLLM's first load compiles for a minute or more, and the benchmark's
warm-up and repeats are then plain requests to the same engine, like every other peer's.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

WORKER = Path(__file__).with_name("vllm_worker.py")
DEFAULT_PEERS = Path(os.environ.get("KVLAB_PEERS", "~/.cache/kvlab-peers")).expanduser()
TCMALLOC = "libtcmalloc_minimal.so.4"
VLLM_CPU_BLOCK_SIZE = 32  # vLLM 0.32's CPU attention takes multiples of 32 only (kvlab's default 16 is refused)


class VLLMPeerError(RuntimeError):
    """The vLLM worker could not start, answered with an error, or went away."""


def default_vllm_python() -> str | None:
    """``$KVLAB_VLLM_PYTHON``, else the venv scripts/peers/vllm.sh makes, if it exists."""
    env = os.environ.get("KVLAB_VLLM_PYTHON")
    if env:
        return env
    py = DEFAULT_PEERS / "vllm" / "bin" / "python"
    return str(py) if py.exists() else None


def default_vllm_model(model: str) -> str | None:
    """What vLLM loads for a kvlab model: an HF directory as it is; for smollm2 the fp32 directory
    scripts/peers/vllm.sh writes (``$KVLAB_VLLM_MODEL``); None for anything else (a mini preset, a GGUF file:
    vLLM has no such model, and a name that is not a directory would send it to a model hub)."""
    if model == "smollm2":
        return os.environ.get("KVLAB_VLLM_MODEL") or str(DEFAULT_PEERS / "smollm2-fp32")
    return model if Path(model).expanduser().is_dir() else None


def default_vllm_w8a8_model(model: str) -> str | None:
    """What the W8A8 peers load for a kvlab model: for smollm2 the directory scripts/peers/vllm.sh writes with
    ``smollm2_w8a8_dir.py`` (``$KVLAB_VLLM_W8A8_MODEL``), kvlab's own int8 codes in vLLM's format; None for
    anything else (pass the directory)."""
    if model == "smollm2":
        return os.environ.get("KVLAB_VLLM_W8A8_MODEL") or str(DEFAULT_PEERS / "smollm2-w8a8")
    return None


def _find_tcmalloc() -> str | None:
    for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/usr/lib", "/lib", "/usr/lib64"):
        p = Path(d) / TCMALLOC
        if p.exists():
            return str(p)
    return None


def vllm_env(python: str, threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment vLLM's CPU backend wants (what scripts/peers/vllm.sh prints), over ``base``: the KV
    space, the cores its OpenMP threads bind to, tcmalloc and the venv's Intel OpenMP preloaded. A value
    already set is kept."""
    env = dict(os.environ if base is None else base)
    env.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local directory: never a hub look-up
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(1, threads) - 1}")
    if "LD_PRELOAD" not in env:
        venv = Path(python).parent.parent
        iomp = venv / "lib" / "libiomp5.so"
        libs = [p for p in (_find_tcmalloc(), str(iomp) if iomp.exists() else None) if p]
        if libs:
            env["LD_PRELOAD"] = ":".join(libs)
    return env


# What ``vllm_env`` preloads into vLLM's worker; in kvlab's own process they replace its OpenMP and allocator.
VLLM_PRELOADS = ("libiomp5", "libtcmalloc")


def preload_warning(environ: Mapping[str, str]) -> str | None:
    """A warning when this process runs with vLLM's preloads (``eval "$(scripts/peers/vllm.sh --env)"`` in the shell
    that runs kvlab): kvlab's own timings are then not kvlab's (measured 20x slower on a busy machine,
    docs/performance.md). The bench gives vLLM's worker its environment itself."""
    found = [lib for lib in environ.get("LD_PRELOAD", "").split(":") if any(p in lib for p in VLLM_PRELOADS)]
    if not found:
        return None
    return (
        f"warning: LD_PRELOAD holds vLLM's libraries ({', '.join(found)}); kvlab's timings in this run carry them. "
        "Unset it: the bench starts vLLM's worker with its environment itself"
    )


@dataclass
class VLLMPeer:
    """One vLLM engine in a worker process. ``start()`` builds it (blocking until ready); ``generate`` sends
    prompts and returns (tokens, seconds); ``close()`` ends the worker. A context manager does both."""

    python: str
    model: str
    llm_kwargs: dict[str, Any] = field(default_factory=dict)
    threads: int = 1
    startup_timeout: float = 900.0  # the first load compiles (60-80 s on 2 cores, more on a busy machine)
    request_timeout: float = 1800.0
    env: dict[str, str] | None = None
    version: str = ""
    setup: str = ""
    _proc: subprocess.Popen[str] | None = field(default=None, init=False, repr=False)
    _lines: queue.Queue[str | None] = field(default_factory=queue.Queue, init=False, repr=False)

    def start(self) -> VLLMPeer:
        if self._proc is not None:
            return self
        if not Path(self.model).expanduser().is_dir():
            raise VLLMPeerError(
                f"vLLM loads an HF directory; {self.model!r} is none (scripts/peers/vllm.sh writes one)"
            )
        if shutil.which(self.python) is None and not Path(self.python).exists():
            raise VLLMPeerError(f"no vLLM interpreter at {self.python} (scripts/peers/vllm.sh makes one)")
        self._proc = subprocess.Popen(
            [self.python, str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # vLLM's log goes where kvlab's stderr goes
            text=True,
            env=self.env if self.env is not None else vllm_env(self.python, self.threads),
            start_new_session=True,  # its own process group: vLLM's engine core goes with it on a kill
        )
        assert self._proc.stdout is not None
        threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True).start()
        hello = self._call({"model": self.model, "llm": self.llm_kwargs}, self.startup_timeout)
        self.version, self.setup = str(hello.get("version", "")), str(hello.get("setup", ""))
        return self

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put(None)

    def _call(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        proc = self._proc
        if proc is None or proc.stdin is None:
            raise VLLMPeerError("the vLLM worker is not running (start() first)")
        try:
            proc.stdin.write(json.dumps(msg) + "\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise VLLMPeerError(f"the vLLM worker went away (exit status {proc.poll()})") from exc
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.close()
                raise VLLMPeerError(f"the vLLM worker gave no answer within {timeout:.0f} s") from None
            if line is None:
                raise VLLMPeerError(f"the vLLM worker exited (status {proc.wait()}) without an answer")
            try:
                answer = json.loads(line)
            except json.JSONDecodeError:
                raise VLLMPeerError(f"the vLLM worker wrote something that is not JSON: {line[:200]!r}") from None
            if "error" in answer:
                raise VLLMPeerError(f"vLLM failed: {answer['error']}\n{answer.get('traceback', '')}".rstrip())
            return dict(answer)

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> tuple[list[list[int]], float]:
        """Greedy, EOS ignored, every prompt at once (as ``run_kvlab``): the tokens and vLLM's own wall time."""
        return self.run([prompts], max_tokens)

    def run(
        self,
        rounds: Sequence[Sequence[Sequence[int]]],
        max_tokens: int,
        n: int = 1,
        temperature: float = 0.0,
        top_k: int = 0,
        seed: int | None = None,
        reset_prefix_cache: bool = False,
    ) -> tuple[list[list[int]], float]:
        """Rounds of prompts, each round's submitted at once after the previous round finished, ``n`` samples
        per prompt, EOS ignored (greedy at temperature 0; vLLM refuses n > 1 there). The tokens of every sequence
        (round, prompt, then sample order) and vLLM's own wall time summed over the rounds. With
        ``reset_prefix_cache`` vLLM forgets every cached prefix first, outside the time."""
        msg: dict[str, Any] = {
            "rounds": [[list(map(int, p)) for p in prompts] for prompts in rounds],
            "max_tokens": max_tokens,
            "n": n,
            "temperature": temperature,
            "top_k": top_k,
            "seed": seed,
            "reset_prefix_cache": reset_prefix_cache,
        }
        answer = self._call(msg, self.request_timeout)
        tokens = [list(map(int, t)) for t in answer["tokens"]]
        expected = sum(len(r) for r in rounds) * n
        if len(tokens) != expected:
            raise VLLMPeerError(f"vLLM returned {len(tokens)} outputs for {expected} sequences")
        return tokens, float(answer["seconds"])

    def spec_metrics(self) -> dict[str, Any]:
        """vLLM's speculative-decoding counters so far: drafts, draft tokens, accepted tokens (and per position)."""
        return self._call({"op": "spec_metrics"}, self.request_timeout)

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None and proc.poll() is None:
                proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                proc.stdin.close()
            proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def __enter__(self) -> VLLMPeer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
