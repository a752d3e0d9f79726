"""A Hypothesis state machine drives a 3-tier store (host, disk, remote) against a plain dict model.

Keys are overwritten with new versions and deleted (single-key and batched calls), so the remote tier
must replace objects and forget deleted ones (review B.3: the model never overwrote, so a write-once
remote serving a key's first value could not show). The host tier is tiny and the disk tier small, so
eviction — including dirty eviction that must write back first — happens constantly. ``on_pressure: keep``:
nothing acknowledged may be dropped, so the model is exact.
"""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import tierstore
from tierstore.bench.ops import wait_for_jobs
from tierstore.testing.data import assert_same, chunk, key_of

SIZES = (4000, 8000, 16000)
N_KEYS = 14


def value_of(i: int, version: int = 0):
    return chunk(i * 1000 + version, SIZES[(i + version) % len(SIZES)])


def make_machine(remote_config):
    class StoreMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            import tempfile
            self.dir = tempfile.TemporaryDirectory()
            self.config = {
                "tiers": [
                    {"kind": "host", "capacity": 3 * 8192, "pinned": False},
                    {"kind": "disk", "path": f"{self.dir.name}/disk", "capacity": 6 * 16384},
                    remote_config(self.dir.name),
                ],
                "max_in_flight": 4,
                "on_pressure": "keep",
            }
            self.store = tierstore.open(self.config)
            self.model: dict[int, int] = {}  # key -> the version last put
            self.version = 0

        def check(self, i, got):
            if i in self.model:
                assert_same(got, value_of(i, self.model[i]))  # the last value put, even before flush
            else:
                assert got is None

        @rule(i=st.integers(0, N_KEYS - 1))
        def put(self, i):
            self.version += 1
            assert self.store.put(key_of(i), value_of(i, self.version))
            self.model[i] = self.version

        @rule(ids=st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=4, unique=True))
        def put_many(self, ids):
            self.version += 1
            assert self.store.put_many([(key_of(i), value_of(i, self.version)) for i in ids]) == [True] * len(ids)
            self.model.update(dict.fromkeys(ids, self.version))

        @rule(i=st.integers(0, N_KEYS - 1))
        def get(self, i):
            self.check(i, self.store.get(key_of(i)))

        @rule(ids=st.lists(st.integers(0, N_KEYS - 1), max_size=5))
        def get_many(self, ids):
            for i, got in zip(ids, self.store.get_many([key_of(i) for i in ids]), strict=True):
                self.check(i, got)

        @rule(ids=st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=3))
        def delete(self, ids):
            assert self.store.delete([key_of(i) for i in ids]) <= len(set(ids))
            for i in ids:
                self.model.pop(i, None)
            assert self.store.contains_many([key_of(i) for i in ids]) == [False] * len(ids)

        @rule(ids=st.lists(st.integers(0, N_KEYS - 1), max_size=4))
        def prefetch(self, ids):
            # a promotion an earlier read admitted (retain; 4 promotion workers) may land after this prefetch and
            # evict its chunk from the tiny host tier: let those finish first, so the check below is about the
            # prefetch (a CI run once saw the chunk on disk right after n == 1; reproduced by delaying an admission)
            wait_for_jobs(self.store, ("promote",))
            n = self.store.prefetch([key_of(i) for i in ids]).result(timeout=60)
            present = [i for i in ids if i in self.model]
            # never reports a chunk the store does not hold; the tiny host tier holds any single chunk, but
            # several promoted together may evict each other
            assert n <= len(present)
            if len(present) == 1:
                assert n == 1 and self.store.where(key_of(present[0])) == "host"

        @rule()
        def flush(self):
            self.store.flush(timeout=60)
            for i in self.model:
                assert self.store.where(key_of(i)) is not None
            assert self.store.lookup([key_of(i) for i in sorted(self.model)]) == len(self.model)

        @precondition(lambda self: self.model)
        @rule()
        def close_and_reopen(self):
            self.store.close()
            self.store = tierstore.open(self.config)
            for i in range(N_KEYS):
                self.check(i, self.store.get(key_of(i)))

        @invariant()
        def capacities_hold(self):
            for t in self.store.stats()["tiers"].values():
                assert t["capacity_bytes"] is None or t["used_bytes"] <= t["capacity_bytes"]

        def teardown(self):
            self.store.close()
            self.dir.cleanup()

    return StoreMachine


pytestmark = pytest.mark.slow  # many store lifetimes per example

MACHINE_SETTINGS = settings(max_examples=15, stateful_step_count=30, deadline=None,
                            suppress_health_check=list(HealthCheck))


def test_state_machine_file_remote():
    machine = make_machine(lambda d: {"kind": "remote", "url": f"file://{d}/remote"})
    machine.TestCase.settings = MACHINE_SETTINGS
    machine.TestCase().runTest()


def test_state_machine_s3_remote(s3_server):
    bucket = s3_server.new_bucket()
    counter = iter(range(10**6))
    machine = make_machine(lambda d: {"kind": "remote", "url": f"s3://{bucket}/run{next(counter)}",
                                      "storage_options": s3_server.storage_options})
    machine.TestCase.settings = settings(MACHINE_SETTINGS, max_examples=6)
    machine.TestCase().runTest()
