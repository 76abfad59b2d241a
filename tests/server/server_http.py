"""The server tests' helpers: a live kvlab server on 127.0.0.1 (free port, background thread) and a small HTTP
client for it, imported as ``server.server_http`` (tests/ is on the path). Not from conftest: ``from conftest import
...`` finds whichever conftest was imported first under that name (tests/fuzz's, in a run that collects both)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

from kvlab.server.serve import RunningServer, ServerConfig

TIMEOUT = 60.0  # safety bound per HTTP call, not an assertion on speed
# The test servers' /metrics key, as an operator's scraper would hold it: with the default policy (block
# reports, no exact cached_tokens) /metrics is closed to everyone else (tenancy.metrics_access).
METRICS_KEY = "test-metrics-key"


class Http:
    def __init__(self, base_url: str, metrics_key: str | None = None) -> None:
        self.base_url = base_url
        self.metrics_key = metrics_key  # sent for /metrics only, never to the other routes

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base_url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
        )
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
                raw = resp.read().decode()
                status = resp.status
        except urllib.error.HTTPError as exc:
            raw, status = exc.read().decode(), exc.code
        return status, (json.loads(raw) if raw and not raw.startswith("data:") else raw)

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
        req = urllib.request.Request(self.base_url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def metrics(self) -> dict[str, float]:
        """Every ``kvlab:`` sample by its name without the prefix (``prefix_cache_hits_total``), with its labels
        other than ``model_name`` in braces (``request_success_total{finished_reason="length"}``), parsed
        by prometheus_client's own parser."""
        out: dict[str, float] = {}
        for family in self.metric_families():
            for sample in family.samples:
                if not sample.name.startswith("kvlab:"):
                    continue
                assert sample.labels.get("model_name"), f"{sample.name} has no model_name label"
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name")
                out[sample.name.removeprefix("kvlab:") + (f"{{{labels}}}" if labels else "")] = sample.value
        return out

    def metric_families(self) -> list[Any]:
        from prometheus_client.parser import text_string_to_metric_families

        key = {"Authorization": f"Bearer {self.metrics_key}"} if self.metrics_key else None
        status, text = self.get("/metrics", key)
        assert status == 200, text
        return list(text_string_to_metric_families(text))

    def open_stream(
        self, body: dict[str, Any], path: str = "/v1/completions", headers: dict[str, str] | None = None
    ) -> socket.socket:
        """Send a streaming request on a raw socket and return once the first event has arrived."""
        host, port = self.base_url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
        data = json.dumps({**body, "stream": True}).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        buf = b""
        while b"data:" not in buf:
            chunk = sock.recv(4096)
            assert chunk, f"the server closed the stream before the first event: {buf!r}"
            buf += chunk
        assert buf.startswith(b"HTTP/1.1 200"), buf[:200]
        return sock


def start(**kw: Any) -> RunningServer:
    """A server with ``kw`` as its config; a metrics key unless the test chooses the /metrics policy itself."""
    if "metrics_api_key" not in kw and not kw.get("public_metrics"):
        kw["metrics_api_key"] = METRICS_KEY
    return RunningServer(ServerConfig(port=0, **kw)).start()


def http_of(srv: RunningServer) -> Http:
    return Http(srv.base_url, srv.cfg.metrics_api_key)
