"""A live kvlab server on 127.0.0.1 (free port, background thread), always stopped after the tests; the helpers
are in ``server_http``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvlab.server.serve import RunningServer
from server.server_http import Http, http_of, start


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    srv = start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Http:
    return http_of(server)


@pytest.fixture
def make_server() -> Iterator[Any]:
    """Start extra servers (other knobs); each is stopped when the test ends, pass or fail."""
    started: list[RunningServer] = []

    def make(**kw: Any) -> tuple[RunningServer, Http]:
        srv = start(**kw)
        started.append(srv)
        return srv, http_of(srv)

    yield make
    for srv in started:
        srv.stop()
