"""Under load, bad requests cost their senders only: 200 concurrent clients, a quarter of them faulty,
every normal answer equal to the offline engine's, none lost."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvlab import LLM, SamplingParams

WORDS = ["amber", "silver", "violet", "cobalt", "scarlet", "ivory", "jade", "onyx", "coral", "slate"]

# (what, body or raw bytes, expected status)
FAULTS: list[tuple[str, Any, int]] = [
    ("malformed JSON", b'{"model": "mini", "prompt": ', 400),
    ("empty prompt", {"model": "mini", "prompt": ""}, 400),
    ("prompt over max_model_len", {"model": "mini", "prompt": "x" * 5000}, 400),
    ("token id outside the vocabulary", {"model": "mini", "prompt": [1, 2, 10**6]}, 400),
    ("negative max_tokens", {"model": "mini", "prompt": "hi", "max_tokens": -3}, 400),
    ("unknown model", {"model": "nope", "prompt": "hi"}, 404),
    ("temperature 1e-40 (once killed the engine)", {"model": "mini", "prompt": "hi", "temperature": 1e-40}, 200),
    ("top_p 1e-46 (once killed the engine)", {"model": "mini", "prompt": "hi", "temperature": 1, "top_p": 1e-46}, 200),
    ("a JSON array", [1, 2, 3], 400),
    ("NaN temperature", b'{"model": "mini", "prompt": "hi", "temperature": NaN}', 400),
]


def test_200_clients_with_faulty_ones_mixed_in(server, http) -> None:
    prompts = [f"Load test {i}: the passphrase is {WORDS[i % 10]} {WORDS[(i // 10) % 10]}" for i in range(150)]
    expected = [o.token_ids for o in LLM("mini").generate(prompts, SamplingParams(temperature=0, max_tokens=8))]

    def normal(i: int) -> tuple[int, Any]:
        return http.post("/v1/completions", {"model": "mini", "prompt": prompts[i], "max_tokens": 8, "temperature": 0})

    def faulty(i: int) -> tuple[int, Any]:
        _, body, _ = FAULTS[i % len(FAULTS)]
        return http.post("/v1/completions", body)

    jobs = [("normal", i) for i in range(150)] + [("faulty", i) for i in range(50)]
    jobs = jobs[::2] + jobs[1::2]  # interleaved, so faults arrive while normal requests are in flight
    with ThreadPoolExecutor(max_workers=200) as pool:
        results = list(pool.map(lambda job: (normal if job[0] == "normal" else faulty)(job[1]), jobs))
    lost, wrong = [], []
    for (kind, i), (status, body) in zip(jobs, results, strict=True):
        if kind == "normal":
            if status != 200:
                lost.append((i, status, body))
            elif body["choices"][0]["token_ids"] != expected[i]:
                wrong.append(i)
        else:
            what, _, want = FAULTS[i % len(FAULTS)]
            assert status == want, f"{what}: {status} {body}"
            if status >= 400:
                assert set(body["error"]) >= {"message", "type", "param", "code"}, what
    assert not lost, f"{len(lost)} normal requests lost: {lost[:3]}"
    assert not wrong, f"{len(wrong)} normal answers differ from the offline engine: {wrong[:10]}"
    assert http.get("/health")[0] == 200
