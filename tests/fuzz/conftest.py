from __future__ import annotations

import pytest
from fuzz_rig import runner

from kvlab.fuzz import TrialRunner


@pytest.fixture
def safe_runner() -> TrialRunner:
    return runner()
