"""/metrics as a side channel: the server's prefix-cache-hit counter, read right before and right after one
of the probe's own requests. The probe sends one request at a time, so on an otherwise idle server the
counter moves by exactly the prompt tokens that request found cached: ``cached_tokens``, however the
response reports it, in blocks or not at all. On a busy server other clients' hits add to it (noise the
calibration sees as irregular deltas).

The probe first finds out whether /metrics answers it at all (``find_metrics``): without a key, then with
its own API key (a tenant's key that opens /metrics is a finding of its own), or only with the metrics key
an operator auditing their own server gives it. Counter names: kvlab's, and vLLM's current and older ones.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvlab.probe.client import ProbeClient, ProbeError

HIT_COUNTERS = ("kvlab:prefix_cache_hits_total", "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
# A sample line of the text format: name, labels (a label value may hold "}" or spaces: the last "}" closes
# them, since neither the value nor the optional timestamp has one), value.
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{.*\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
T = TypeVar("T")
_HOW = {"none": "without a key", "metrics key": "with the given metrics API key", "API key": "with the probe's API key"}


def hit_counter(text: str) -> tuple[str, float] | None:
    """The first of ``HIT_COUNTERS`` in a Prometheus exposition, summed over its series (one per model or
    engine); None when it has none."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m[1] not in HIT_COUNTERS:
            continue
        try:
            totals[m[1]] = totals.get(m[1], 0.0) + float(m[2])
        except ValueError:
            continue
    name = next((n for n in HIT_COUNTERS if n in totals), None)
    return None if name is None else (name, totals[name])


@dataclass
class MetricsCheck:
    """What /metrics showed the probe."""

    status: int | None  # of GET /metrics; None: not answered
    opened_by: str = ""  # the credential it answered 200 to: "none" | "API key" | "metrics key"
    counter: str | None = None  # the hit counter found
    own_hit: int | None = None  # the counter's delta for the probe's own repeated prompt; None: not measured
    detail: str = ""  # why it was not answered, or not calibrated

    @property
    def readable(self) -> bool:
        return self.status == 200 and self.counter is not None

    def summary(self) -> str:
        if self.status is None:
            return f"not reachable ({self.detail})"
        if self.status != 200:
            return f"not reachable ({self.status})" if self.status in (401, 403) else f"not offered ({self.status})"
        how = f"reachable {_HOW.get(self.opened_by, self.opened_by)}"
        if self.counter is None:
            return f"{how}: no prefix-cache-hit counter ({', '.join(HIT_COUNTERS)})"
        if self.own_hit is None:
            return f"{how}: {self.counter} (not calibrated{': ' + self.detail if self.detail else ''})"
        if self.own_hit > 0:
            return (
                f"{how}: reveals cache hits of every request ({self.counter} moved by {self.own_hit} for the "
                "probe's own repeated prompt)"
            )
        return f"{how}: {self.counter} did not move for the probe's own repeated prompt"


class MetricsReader:
    """Reads the hit counter, over a connection of its own, with the credential that opened /metrics."""

    def __init__(self, client: ProbeClient, counter: str) -> None:
        self.client = client
        self.counter = counter

    def hits(self) -> float:
        """The counter's value now. A ``ProbeError`` once /metrics stops showing it: read as "no hit", a lost
        counter would make every guess a miss, and the attack conclude "no leak" from an error."""
        status, text = self.client.get("/metrics")
        found = hit_counter(text) if status == 200 else None
        if found is None or found[0] != self.counter:
            raise ProbeError(f"GET {self.client.base_url}/metrics answered {status} without {self.counter}")
        return found[1]

    def close(self) -> None:
        self.client.close()


def find_metrics(
    base_url: str, timeout: float, metrics_api_key: str | None = None, api_key: str | None = None
) -> tuple[MetricsCheck, MetricsReader | None]:
    """Whether /metrics answers, and a reader of its hit counter if it shows one (close it when done). With a
    metrics key only that key is tried (an operator's audit); else no key, then the probe's own API key."""
    tries = [("metrics key", metrics_api_key)] if metrics_api_key else [("none", None), ("API key", api_key)]
    first: MetricsCheck | None = None
    for label, key in tries:
        if label == "API key" and not key:
            continue
        client = ProbeClient(base_url, "", timeout, api_key=key, max_connections=1)
        try:
            status, text = client.get("/metrics")
        except ProbeError as exc:
            client.close()
            return MetricsCheck(None, detail=str(exc)), None
        if status == 200:
            found = hit_counter(text)
            if found is None:
                client.close()
                return MetricsCheck(200, label), None
            return MetricsCheck(200, label, found[0]), MetricsReader(client, found[0])
        client.close()
        first = first or MetricsCheck(status)  # the refusal without a key says most about the server
    return first or MetricsCheck(None, detail="no request was made"), None


def own_hit(deltas: Sequence[int | None]) -> int | None:
    """The largest delta the probe's own cache hits moved the counter by; None when none was measured."""
    values = [d for d in deltas if d is not None]
    return max(values) if values else None


def metered(counter: Callable[[], float | None], send: Callable[[], T]) -> tuple[T, int | None]:
    """What ``send()`` returns, and the counter's delta around it: the hits of that one request on an idle
    server (None where the counter could not be read)."""
    before = counter()
    result = send()
    after = counter()
    return result, None if before is None or after is None else round(after - before)


def check_metrics(
    client: ProbeClient, prompt: str, metrics_api_key: str | None = None, api_key: str | None = None
) -> MetricsCheck:
    """``find_metrics``, then ``prompt`` sent twice by ``client``: how far the counter moves for the second,
    the probe's own cache hit (so it should be long enough to fill a block)."""
    check, reader = find_metrics(client.base_url, client.timeout, metrics_api_key, api_key)
    if reader is None:
        return check
    try:
        client.completion(prompt, 1)
        _, check.own_hit = metered(reader.hits, lambda: client.completion(prompt, 1))
    except ProbeError as exc:  # a side check: the rest of the probe's findings stand without it
        check.detail = str(exc)
    finally:
        reader.close()
    return check
