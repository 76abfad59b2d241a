"""The first engine a process builds freezes the collector's heap (kvlab.engine.heap.freeze_live_objects), and what
that relies on: an engine, its model and an ``LLM`` are freed by their reference counts alone, since a frozen object
in a reference cycle would never be freed."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from kvlab import LLM, SamplingParams
from kvlab.config import SpeculativeConfig
from kvlab.instrument.trace import Trace
from kvlab.model import load_model


@pytest.fixture
def collector_off() -> Iterator[None]:
    """Only reference counts free anything while the test runs."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


FIRST_ENGINES = """
import gc, json
from kvlab import LLM, SamplingParams
def walked(obj):
    return any(o is obj for o in gc.get_objects())
assert gc.get_freeze_count() == 0
llm = LLM("mini", num_blocks=64)
engine, frozen = llm.engine, gc.get_freeze_count()
first = [walked(o) for o in (engine.model, engine.storage, engine.kv, engine.runner, engine.loaded.model)]
made_later = [object()]
llm.generate(["a prompt"], SamplingParams(max_tokens=4))
second = LLM("mini", num_blocks=64, attention_backend="cpp")
print(json.dumps({"frozen": frozen, "first": first, "later": walked(made_later),
                  "second": walked(second.engine.model)}))
"""


def test_the_first_engine_freezes_what_exists_and_later_ones_leave_it() -> None:
    """In a fresh interpreter: the freeze is once per process, and the suite's own process has done it already."""
    out = subprocess.run([sys.executable, "-c", FIRST_ENGINES], capture_output=True, text=True, check=True, timeout=300)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["frozen"] > 50_000  # torch and the rest of what the imports made: the bulk a collection walked
    assert seen["first"] == [False] * 5  # the first engine's model, cache, manager and runner, the loaded model
    assert seen["later"] is True  # what is made after the build is collected as before
    assert seen["second"] is True  # the second engine froze nothing: its model stays with the collector


ENGINES: dict[str, dict[str, Any]] = {
    "reference": {},
    "cpp": {"attention_backend": "cpp"},
    "packed": {"packed_weights": True},
    "int8": {"quantization": "int8"},
    "int8-w8a8+cpp": {"quantization": "int8-w8a8", "attention_backend": "cpp"},
    "speculative": {"speculative": SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2)},
    "sanitized+traced": {"sanitize": True, "trace": Trace()},
}


@pytest.mark.parametrize("name", list(ENGINES))
def test_a_dropped_engine_and_its_model_are_freed_without_the_collector(name: str, collector_off: None) -> None:
    loaded = load_model("mini")
    llm = LLM(loaded, num_blocks=64, **ENGINES[name])
    prompts = ["the shared start of two prompts, one", "the shared start of two prompts, two"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=1))
    assert all(len(c.token_ids) == 6 for o in outs for c in o.outputs)
    refs = {
        "llm": weakref.ref(llm),
        "engine": weakref.ref(llm.engine),
        "storage": weakref.ref(llm.engine.storage),
        "manager": weakref.ref(llm.engine.kv),
    }
    # The engine's model is the loaded one (the reference) or a twin made from it (the other modes).
    models = {"engine model": weakref.ref(llm.engine.model), "loaded model": weakref.ref(loaded.model)}
    del llm, outs
    assert [k for k, r in refs.items() if r() is not None] == []
    del loaded
    assert [k for k, r in models.items() if r() is not None] == []
