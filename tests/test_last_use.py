"""The refresh schedule of shared objects' last use (tierstore/backends/last_use.py), without I/O: a fleet of
clocks over one simulated object pays about 1 + (N - 1) / backoff requests per interval, an object in use
never goes unrefreshed longer than backoff intervals, and reads need no check."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.backends.last_use import UseClock
from tierstore.keys import ChunkKey

K = ChunkKey.from_bytes(b"system-prompt")


def simulate(n: int, users, seconds: float, every: float = 10.0, step: float = 1.0, seed: int = 0):
    """``n`` instances serve K from their host tier; ``users(t)`` says which use it at second ``t``. Returns
    (requests, refresh times) with the object's modification time kept as storage would."""
    rng = random.Random(seed)
    clocks = [UseClock(every) for _ in range(n)]
    modified, requests, refreshes = 0.0, 0, [0.0]
    t = 0.0
    while t < seconds:
        for i in users(t):
            now = t + rng.random() * step
            for key, check in clocks[i].served_above([K], now):
                if check:
                    requests += 1  # a HEAD
                    if now - modified < every:
                        clocks[i].found_fresh(key, modified)
                        continue
                requests += 1  # the copy
                modified = now
                refreshes.append(now)
                clocks[i].refreshed(key, now)
        t += step
    return requests, refreshes


def test_a_fleet_pays_about_one_request_per_interval_not_one_per_instance():
    for n in (1, 8, 64):
        requests, _ = simulate(n, lambda t, n=n: range(n), seconds=2000)
        per_interval = requests / (2000 / 10.0)
        assert per_interval <= 1.25 * (1 + (n - 1) / 4) + 1, (n, per_interval)  # the refresher, the others
        if n == 64:
            assert per_interval < n / 3  # the naive schedule (every instance checks every interval) pays n


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 20), seed=st.integers(0, 10_000), leave=st.integers(0, 19))
def test_an_object_in_use_is_refreshed_at_least_every_backoff_intervals(n, seed, leave):
    # instance ``leave`` (maybe the refresher) stops using the object halfway; the others go on
    gone = leave % n
    users = (lambda t: [i for i in range(n) if not (i == gone and t > 500)]) if n > 1 else (lambda t: [0])
    _, refreshes = simulate(n, users, seconds=1000, seed=seed)
    gaps = [b - a for a, b in zip(refreshes, refreshes[1:], strict=False)]
    assert gaps and max(gaps) <= 4 * 10.0 + 2 * 1.0  # backoff × every, plus one step of sampling either side


def test_reads_decide_without_a_check_and_our_own_refresh_is_not_repeated():
    c = UseClock(10.0)
    assert not c.read(K, modified=95.0, now=100.0)  # fresh: nothing to do
    assert c.read(K, modified=50.0, now=100.0)  # stale: refresh (a copy, no HEAD)
    assert not c.read(K, modified=50.0, now=101.0)  # our refresh is on its way
    c.refreshed(K, 101.0)
    assert c.served_above([K], 105.0) == []  # not due
    assert c.served_above([K], 112.0) == [(K, False)]  # due, and we refreshed last: no check


def test_a_key_first_seen_costs_nothing_and_the_table_is_bounded():
    c = UseClock(10.0, kept=3)
    keys = [ChunkKey.from_bytes(b"%d" % i) for i in range(5)]
    assert c.served_above(keys, 0.0) == []
    assert len(c._due) == 3
    assert c.served_above(keys[-3:], 11.0) == [(k, True) for k in keys[-3:]]  # never refreshed by us: check
