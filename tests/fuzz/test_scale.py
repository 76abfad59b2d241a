"""Serial, a local process pool and Ray give identical results for the same seed (failing trials and their
shrunk cases included), and a worker that dies loses no trial."""

from __future__ import annotations

import pytest
from fuzz_rig import AlwaysCrash, runner

from kvlab.fuzz import CrashInjection, FuzzSettings, ScaleOptions, run_campaign
from kvlab.fuzz.dispatch import WorkersDying

# shared-no-refcount fails in some trials and not others: the comparison covers passing trials, failing
# ones and their shrunk cases (shrinking is seeded by the trial, so it must agree across workers too).
STRATEGY = "shared-no-refcount"
TRIALS = 8
BUDGET = 8


@pytest.fixture(scope="module")
def serial():
    r = runner(STRATEGY, BUDGET)
    summary = run_campaign(r.settings, TRIALS, runner=r)
    assert 0 < summary.failures < TRIALS  # the comparison below covers both kinds of trial
    return summary


def test_pool_equals_serial_and_survives_a_dead_worker(serial, tmp_path):
    settings = runner(STRATEGY, BUDGET).settings
    # Trial 5 kills the first worker that reaches it: the pool breaks, every chunk in flight is retried.
    crash = CrashInjection((5,), str(tmp_path))
    pooled = run_campaign(settings, TRIALS, ScaleOptions(workers=2, chunk_size=3, crash=crash))
    assert pooled.outcome() == serial.outcome()
    assert pooled.worker_deaths == 1 and pooled.retried_trials >= 1
    assert (tmp_path / "crashed-5").exists()


def test_a_trial_that_always_kills_its_worker_is_reported_not_lost(tmp_path):
    r = runner(None, BUDGET)
    opts = ScaleOptions(workers=2, chunk_size=2, max_attempts=2, crash=AlwaysCrash((1,), str(tmp_path)))
    summary = run_campaign(r.settings, 4, opts)
    assert [t.index for t in summary.failing] == [1]
    assert summary.failing[0].failures[0].kind == "crash" and "killed its worker 2 times" in str(
        summary.failing[0].failures[0]
    )
    # One death broke the pool with both chunks in flight (pinned on nobody); trial 1, run alone, then killed
    # its worker twice.
    assert summary.trials == 4 and summary.worker_deaths == 3


def test_ray_equals_serial_and_survives_a_dead_actor(serial, tmp_path):
    ray = pytest.importorskip("ray", reason="Ray is the optional 'ray' extra (pip install 'kvlab[ray]')")
    settings = runner(STRATEGY, BUDGET).settings
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = run_campaign(settings, TRIALS, ScaleOptions(workers=2, ray="auto", chunk_size=3))
        assert on_ray.outcome() == serial.outcome() and on_ray.executor == "ray"
        crash = CrashInjection((7,), str(tmp_path))
        killed = run_campaign(settings, TRIALS, ScaleOptions(workers=2, ray="auto", chunk_size=3, crash=crash))
        assert killed.outcome() == serial.outcome()
        assert killed.worker_deaths == 1 and killed.retried_trials == 2  # its chunk, trials 6 and 7
        with pytest.raises(WorkersDying, match="could not start"):
            run_campaign(FuzzSettings(model="no-such-model"), 2, ScaleOptions(workers=1, ray="auto"))
    finally:
        ray.shutdown()


def test_workers_that_cannot_start_stop_the_campaign():
    with pytest.raises(WorkersDying, match="could not start: ModelLoadError: unknown model 'no-such-model'"):
        run_campaign(FuzzSettings(model="no-such-model"), 4, ScaleOptions(workers=1))
