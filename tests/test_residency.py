"""The control plane alone (:mod:`tierstore.residency`): no threads, no files, no tensors.

A Hypothesis state machine drives a :class:`Residency` over three levels (a small top, a middle one and an
unbounded shared bottom) through interleaved puts, write-backs, evictions, promotions, pins, deletes, failing
writes and vanishing copies, with a plain dict standing in for storage — the data plane is simulated here
exactly as :mod:`tierstore.transfers` carries plans out. After every step it checks the rules of the module
docstring: exact capacity, the index agreeing with storage, no read ever served an older value than the last
acknowledged put, and after a drain nothing acknowledged lost unless a flush reports it.
"""

from __future__ import annotations

import os

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tierstore.flushes import FlushState
from tierstore.keys import ChunkKey
from tierstore.residency import REMOVING, Hold, LevelSpec, Pressure, Residency, Slot, Victim

UNIT = 100
KEYS = [ChunkKey.from_bytes(b"residency %d" % i) for i in range(6)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Plane:
    """Storage as a dict ``(level, key) -> generation``, and the data plane's moves over it."""

    def __init__(self, res: Residency, sizes: dict[int, int]) -> None:
        self.res = res
        self.storage: dict[tuple[int, ChunkKey], int] = {}
        self.sizes = sizes  # generation -> bytes (every level stores a value at the same size here)
        self.broken: set[int] = set()

    def land(self, key: ChunkKey, level: int, gen: int, *, put: bool = False, queue: bool = True) -> str:
        slot = self.res.begin_write(key, level, gen)
        if slot is not Slot.OK:
            return slot.value
        return self.write_held(key, level, gen, put=put, queue=queue)

    def write_held(self, key: ChunkKey, level: int, gen: int, *, put: bool = False, queue: bool = True,
                   data: int | None = None) -> str:
        """Write generation ``gen`` of ``key`` into ``level`` whose slot the caller holds. ``data``: the value
        actually read for it (a source replaced by a put in flight while it was read gives a newer one)."""
        size = self.sizes[gen]
        reserved = self.make_room(key, level, size)
        if reserved is None or level in self.broken:
            self.res.abort_write(key, level, gen, reserved or 0, failed=True)
            return "refused"
        self.storage[(level, key)] = gen if data is None else data
        for j in self.res.commit_write(key, level, gen, size, reserved, put=put, queue=queue):
            if self.res.claim_stale(key, j):
                self.storage.pop((j, key), None)
                self.res.removed(j, key)
        return "ok"

    def make_room(self, key: ChunkKey, level: int, size: int) -> int | None:
        for _ in range(64):
            room = self.res.reserve(key, level, size)
            if room.reserved is not None:
                return room.reserved
            if not room.victims:
                return None  # a store would wait for others here; nothing else runs in this model
            for victim in room.victims:
                self.evict(victim)
        return None

    def evict(self, victim: Victim) -> None:
        down, tried = victim.down, []
        while isinstance(down, int) and down is not False:
            data = self.storage.get((victim.level, victim.key))
            if data is None:
                break  # it vanished: nothing left to save (its pending levels are given up later)
            assert data == victim.gen, "a dirty victim holds its value (its slot is held)"
            if self.land(victim.key, down, victim.gen) in ("ok", "superseded"):
                break
            tried.append(down)
            down = self.res.written_down_failed(victim, tried)
        if down is False:
            self.res.keep(victim)
            return
        if self.res.may_evict(victim):
            self.storage.pop((victim.level, victim.key), None)
            self.res.evicted(victim)

    def write_back(self, level: int, limit: int, fail: bool = False) -> int:
        writes, stale = self.res.take_due(level, limit)
        for key, j in stale:
            if self.res.claim_stale(key, j):
                self.storage.pop((j, key), None)
                self.res.removed(j, key)
        for w in writes:
            self.finish(w, fail)
        return len(writes)

    def finish(self, w, fail: bool) -> None:
        """Carry out write-back ``w``: read its source (a vanished one is lost), then write or fail."""
        stored = self.storage.get((w.source, w.key))
        self.res.unpin([Hold(w.key, w.source, w.source_size, w.gen)])
        if stored is None:
            self.res.lost(w.source, w.key, w.gen, remove=False)
            fail = True
        else:  # a put may have replaced the source since it was chosen: then a newer value is read
            assert stored >= w.gen, "write-back never reads an older value than it writes"
        if fail or w.level in self.broken:
            self.res.abort_write(w.key, w.level, w.gen, failed=True)
        else:
            self.write_held(w.key, w.level, w.gen, data=stored)


class ResidencyMachine(RuleBasedStateMachine):
    """See the module docstring."""

    @initialize(pressure=st.sampled_from(list(Pressure)), through=st.booleans())
    def setup(self, pressure, through):
        self.clock = Clock()
        self.specs = [LevelSpec("host", 3 * UNIT), LevelSpec("disk", 6 * UNIT),
                      LevelSpec("remote", None, shared=True)]
        self.res = Residency(self.specs, pressure, clock=self.clock)
        self.sizes: dict[int, int] = {}
        self.plane = Plane(self.res, self.sizes)
        self.through = through
        self.acked: dict[ChunkKey, int | None] = {}  # last acknowledged generation (None: deleted)
        self.in_flight: dict[ChunkKey, set[int]] = {}  # generations of puts not yet acknowledged
        self.puts: list[dict] = []  # puts holding their slot at the top level, not yet written
        self.pins: list[Hold] = []
        self.deletes: list[ChunkKey] = []
        self.writes: list = []  # write-backs taken, not yet done

    # ------------------------------------------------------------------ helpers
    def busy(self, key: ChunkKey) -> bool:
        rec = self.res._keys.get(key)
        return rec is not None and bool(rec.busy or rec.deleting)

    def new_gen(self, key: ChunkKey, units: int) -> int:
        gen = self.res.next_gen()
        self.sizes[gen] = units * UNIT
        self.in_flight.setdefault(key, set()).add(gen)
        return gen

    def acknowledge(self, key: ChunkKey, gen: int, landed: bool) -> None:
        self.in_flight[key].discard(gen)
        if landed and (self.acked.get(key) is None or gen > (self.acked[key] or 0)):
            self.acked[key] = gen

    def put_rest(self, key: ChunkKey, gen: int, first: int) -> bool:
        """Land ``gen`` from level ``first`` down, as a put does (every level under write_through)."""
        landed = False
        for level in range(first, len(self.specs)):
            outcome = self.plane.land(key, level, gen, put=True, queue=not self.through)
            if outcome == "busy":  # a write-back of the key holds the level: a store waits for it to end
                for w in [w for w in self.writes if w.key == key]:
                    self.writes.remove(w)
                    self.plane.finish(w, fail=False)
                outcome = self.plane.land(key, level, gen, put=True, queue=not self.through)
            assert outcome != "busy", "nothing else holds the key's slots in this model"
            if outcome in ("ok", "superseded"):
                landed = True
                if not self.through or outcome == "superseded":
                    break
        return landed

    # ------------------------------------------------------------------ rules
    @rule(k=st.sampled_from(KEYS), units=st.integers(1, 2))
    def put(self, k, units):
        if self.busy(k):
            return
        gen = self.new_gen(k, units)
        self.acknowledge(k, gen, self.put_rest(k, gen, 0))

    @rule(k=st.sampled_from(KEYS), units=st.integers(1, 2))
    def start_put(self, k, units):
        """A put holding the top level's slot and its reservation, its bytes not written yet."""
        if self.busy(k):
            return
        gen = self.new_gen(k, units)
        assert self.res.begin_write(k, 0, gen) is Slot.OK
        reserved = self.plane.make_room(k, 0, self.sizes[gen])
        if reserved is None:
            self.res.abort_write(k, 0, gen)
            self.acknowledge(k, gen, self.put_rest(k, gen, 1))
            return
        self.puts.append({"key": k, "gen": gen, "reserved": reserved})

    @precondition(lambda self: self.puts)
    @rule(data=st.data(), fail=st.booleans())
    def finish_put(self, data, fail):
        op = self.puts.pop(data.draw(st.integers(0, len(self.puts) - 1)))
        k, gen = op["key"], op["gen"]
        if fail:  # the top level refused: the put goes on below
            self.res.abort_write(k, 0, gen, op["reserved"])
            self.acknowledge(k, gen, self.put_rest(k, gen, 1))
            return
        self.plane.storage[(0, k)] = gen
        for j in self.res.commit_write(k, 0, gen, self.sizes[gen], op["reserved"], put=True, queue=not self.through):
            if self.res.claim_stale(k, j):
                self.plane.storage.pop((j, k), None)
                self.res.removed(j, k)
        landed = True
        if self.through:
            landed = self.put_rest(k, gen, 1) or landed
        self.acknowledge(k, gen, landed)

    @rule(level=st.integers(1, 2), limit=st.integers(1, 4), fail=st.booleans())
    def write_back(self, level, limit, fail):
        self.plane.write_back(level, limit, fail or level in self.plane.broken)

    @rule(level=st.integers(1, 2))
    def start_write_back(self, level):
        writes, stale = self.res.take_due(level, 1)
        for key, j in stale:
            if self.res.claim_stale(key, j):
                self.plane.storage.pop((j, key), None)
                self.res.removed(j, key)
        self.writes.extend(writes)

    @precondition(lambda self: self.writes)
    @rule(data=st.data(), fail=st.booleans())
    def finish_write_back(self, data, fail):
        self.plane.finish(self.writes.pop(data.draw(st.integers(0, len(self.writes) - 1))), fail)

    @rule(k=st.sampled_from(KEYS))
    def read(self, k):
        (hold,) = self.res.pin([k])
        if hold is not None:
            stored = self.plane.storage.get((hold.level, k))
            if stored is not None:  # (a copy vanished behind the index's back reads as a miss)
                assert stored >= hold.gen
                self.check_value(k, stored)
            else:
                self.res.lost(hold.level, k, hold.gen, remove=False)
        self.res.unpin([hold])

    @rule(k=st.sampled_from(KEYS))
    def pin(self, k):
        (hold,) = self.res.pin([k])
        if hold is not None:
            self.pins.append(hold)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        self.res.unpin([self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))])

    @rule(k=st.sampled_from(KEYS))
    def start_delete(self, k):
        if k in self.deletes or not self.res.begin_delete(k):
            return
        self.deletes.append(k)
        self.finish_deletes()

    def finish_deletes(self):
        for k in list(self.deletes):
            levels = self.res.delete_ready(k)
            if levels is None:
                continue
            for level in levels:
                self.plane.storage.pop((level, k), None)
            self.res.end_delete(k)
            self.deletes.remove(k)
            self.acked[k] = None

    @rule(k=st.sampled_from(KEYS))
    def promote(self, k):
        (source,) = self.res.locate([k])
        if source is None or source == 0:
            return
        (hold,) = self.res.pin([k])
        assert hold is not None and hold.level == source
        data = self.plane.storage.get((source, k))
        self.res.unpin([hold])
        if data is None:
            return
        if not self.res.begin_promote(k, source, hold.gen, 0):
            return
        if self.plane.write_held(k, 0, hold.gen, data=data) == "ok":
            self.res.fill(k, hold.gen, range(1, source))

    @rule(level=st.integers(1, 2))
    def break_level(self, level):
        self.plane.broken.add(level)

    @rule(level=st.integers(1, 2))
    def heal_level(self, level):
        self.plane.broken.discard(level)

    @rule(dt=st.sampled_from([0.01, 0.1, 1.0, 10.0]))
    def advance_clock(self, dt):
        self.clock.now += dt

    @rule(k=st.sampled_from(KEYS), level=st.integers(0, 2))
    def vanish(self, k, level):
        """A copy disappears from storage behind the index's back (removed by hand, damaged)."""
        self.plane.storage.pop((level, k), None)
        self.vanished = True

    @rule()
    def drain(self):
        """Finish everything in flight and write back until nothing is due: what a flush waits for."""
        for w in self.writes:
            self.plane.finish(w, fail=True)
        self.writes.clear()
        for op in self.puts:
            self.res.abort_write(op["key"], 0, op["gen"], op["reserved"])
            self.acknowledge(op["key"], op["gen"], self.put_rest(op["key"], op["gen"], 1))
        self.puts.clear()
        self.finish_deletes()
        state = self.res.flush_begin()
        for _ in range(200):
            self.clock.now += self.res.max_retry_delay + 1
            moved = sum(self.plane.write_back(level, 8, level in self.plane.broken) for level in (1, 2))
            if self.res.flush_settled(state) and not moved:
                break
        assert self.res.flush_settled(state), "a drain settles everything pending when it began"
        failed, dropped = self.res.losses()
        if getattr(self, "vanished", False):
            return  # a copy removed behind our back may be the only one: its loss is reported, not checked
        for k, gen in self.acked.items():
            if gen is None or k in failed or k in dropped or self.in_flight.get(k):
                continue
            (hold,) = self.res.pin([k])
            self.res.unpin([hold])
            assert hold is not None, f"acknowledged {k.hex()[:8]} lost without a report"
            assert hold.gen == gen and self.plane.storage[(hold.level, k)] == gen
            if not self.plane.broken:
                assert self.plane.storage.get((2, k)) == gen, "write-back reached the bottom level"

    # ------------------------------------------------------------------ invariants
    def check_value(self, k: ChunkKey, gen: int) -> None:
        allowed = {self.acked.get(k)} | self.in_flight.get(k, set())
        assert gen in allowed, f"served generation {gen} of {k.hex()[:8]}, allowed {allowed}"

    @invariant()
    def capacity_is_exact(self):
        for lv in self.res.levels:
            assert lv.used == sum(p & ((1 << 48) - 1) for p in lv.copies.values())
            assert lv.reserved >= 0 and lv.evicting_bytes >= 0
            if lv.spec.capacity is not None:
                assert lv.used + lv.reserved <= lv.spec.capacity

    @invariant()
    def index_agrees_with_storage(self):
        for i, lv in enumerate(self.res.levels):
            for k, packed in lv.copies.items():
                rec = self.res._keys.get(k)
                if rec is not None and i in rec.busy:
                    continue
                stored = self.plane.storage.get((i, k))
                if stored is None:
                    continue  # vanished behind our back
                assert stored >= packed >> 48, "a copy never holds an older value than its index says"
                if rec is None or (packed >> 48 == rec.gen and not rec.deleting):
                    self.check_value(k, stored)

    @invariant()
    def every_pending_level_is_queued_or_being_written(self):
        """A pending level is never orphaned: due, waiting for a retry, or its write in flight."""
        in_flight = {(w.key, w.level) for w in self.writes}
        for k, rec in self.res._keys.items():
            if rec.deleting:
                continue  # its delete clears them when it ends
            for level in rec.pending:
                lv = self.res.levels[level]
                queued = k in lv.ready or k in lv.retry_at or level in rec.busy or (k, level) in in_flight
                assert queued, f"pending level {level} of {k.hex()[:8]} is neither due nor retried"

    @invariant()
    def flush_counters_match_the_pending_levels(self):
        """The flush tracker's counts (what a flush waits for, kept as writes commit) equal a walk of the keys."""
        fast = self.res.fast_retries
        outstanding = sum(1 for rec in self.res._keys.values() for a in rec.pending.values() if a < fast)
        failing = {(k, j) for k, rec in self.res._keys.items() for j, a in rec.pending.items() if a >= fast}
        assert self.res.dirty() == sum(1 for rec in self.res._keys.values() if rec.pending)
        tracker = self.res._flushes
        assert tracker.outstanding(FlushState(tracker.epoch)) == outstanding
        assert {(k, j) for k, js in tracker.failing.items() for j in js} == failing

    @invariant()
    def current_copies_hold_an_allowed_value(self):
        for k in KEYS:
            (level,) = self.res.locate([k])
            if level is None:
                continue
            rec = self.res._keys.get(k)
            if rec is not None and level in rec.busy and rec.busy[level] == REMOVING:
                continue
            self.check_value(k, self.res.levels[level].copies[k] >> 48)


TestResidencyMachine = ResidencyMachine.TestCase
TestResidencyMachine.settings = settings(max_examples=int(os.environ.get("TIERSTORE_MACHINE_EXAMPLES", 300)),
                                         stateful_step_count=60, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------- focused cases
def _res(pressure=Pressure.DROP, clock=None):
    return Residency([LevelSpec("host", 2 * UNIT), LevelSpec("disk", None), LevelSpec("remote", None, shared=True)],
                     pressure, clock=clock or Clock())


def _put(res: Residency, plane: Plane, key: ChunkKey, units: int = 1) -> int:
    gen = res.next_gen()
    plane.sizes[gen] = units * UNIT
    assert plane.land(key, 0, gen, put=True) == "ok"
    return gen


def test_a_put_records_its_copy_and_the_pending_levels_in_one_step():
    res = _res()
    plane = Plane(res, {})
    gen = _put(res, plane, KEYS[0])
    assert res.locate([KEYS[0]]) == [0]
    assert res.level_stats(1)["writeback_pending"] == 1 and res.level_stats(2)["writeback_pending"] == 1
    writes, _ = res.take_due(1, 8)
    assert [(w.key, w.level, w.gen, w.source) for w in writes] == [(KEYS[0], 1, gen, 0)]


def test_a_dirty_victim_is_written_down_before_it_goes():
    res = _res()
    plane = Plane(res, {})
    g0 = _put(res, plane, KEYS[0], 2)
    _put(res, plane, KEYS[1], 1)  # needs room: KEYS[0] is dirty and must reach disk first
    assert plane.storage[(1, KEYS[0])] == g0
    assert res.locate([KEYS[0]]) == [1]
    assert res.level_stats(0)["evictions"] == 1


def test_under_keep_a_dirty_victim_nothing_below_takes_stays_and_the_put_skips_the_level():
    clock = Clock()
    res = _res(Pressure.KEEP, clock)
    plane = Plane(res, {})
    plane.broken = {1, 2}
    _put(res, plane, KEYS[0], 2)
    for level in (1, 2):  # the write-backs fail: the levels back off
        plane.write_back(level, 8, fail=True)
    gen = res.next_gen()
    plane.sizes[gen] = UNIT
    assert plane.land(KEYS[1], 0, gen, put=True) == "refused"
    assert res.locate([KEYS[0]]) == [0]


def test_under_drop_a_dirty_victim_nothing_below_takes_is_dropped_and_reported():
    res = _res(Pressure.DROP)
    plane = Plane(res, {})
    plane.broken = {1, 2}
    _put(res, plane, KEYS[0], 2)
    for level in (1, 2):
        plane.write_back(level, 8, fail=True)
    _put(res, plane, KEYS[1], 1)
    assert res.locate([KEYS[0]]) == [None]
    failed, dropped = res.losses()
    assert dropped == {KEYS[0]: {1, 2}} and KEYS[0] not in failed
    assert res.level_stats(1)["writeback_dropped"] == 1


def test_drop_never_lets_an_older_value_below_become_current():
    res = _res(Pressure.DROP)
    plane = Plane(res, {})
    _put(res, plane, KEYS[0], 1)
    plane.write_back(1, 8)  # the first value reaches disk
    plane.broken = {1, 2}
    _put(res, plane, KEYS[0], 2)  # the second stays on host: disk holds the older value
    for level in (1, 2):
        plane.write_back(level, 8, fail=True)
    gen = res.next_gen()
    plane.sizes[gen] = UNIT
    assert plane.land(KEYS[1], 0, gen, put=True) == "refused"  # the dirty victim stays
    (hold,) = res.pin([KEYS[0]])
    assert hold is not None and hold.level == 0


def test_an_overwrite_makes_every_older_copy_unreadable_until_written_again():
    res = _res()
    plane = Plane(res, {})
    _put(res, plane, KEYS[0])
    plane.write_back(1, 8)
    plane.write_back(2, 8)
    assert res.locate([KEYS[0]], levels=[1, 2]) == [1]
    g2 = _put(res, plane, KEYS[0])
    assert res.locate([KEYS[0]], levels=[1, 2]) == [None]
    plane.write_back(2, 8)
    assert res.locate([KEYS[0]], levels=[1, 2]) == [2]
    assert res.holds_current(KEYS[0], 2, g2)


def test_a_promotion_of_a_value_overwritten_meanwhile_is_refused():
    res = _res()
    plane = Plane(res, {})
    _put(res, plane, KEYS[0])
    plane.write_back(1, 8)
    (hold,) = res.pin([KEYS[0]], levels=[1])
    res.unpin([hold])
    _put(res, plane, KEYS[0])
    assert hold is not None and not res.begin_promote(KEYS[0], 1, hold.gen, 0)


def test_a_delete_waits_for_writes_in_flight_and_refuses_older_ones():
    res = _res()
    plane = Plane(res, {})
    gen = _put(res, plane, KEYS[0])
    writes, _ = res.take_due(1, 8)
    assert res.begin_delete(KEYS[0])
    assert res.delete_ready(KEYS[0]) is None  # the write-back to disk is in flight
    res.unpin([Hold(w.key, w.source, w.source_size, w.gen) for w in writes])
    plane.storage[(1, KEYS[0])] = gen
    res.commit_write(KEYS[0], 1, gen, UNIT, 0)
    assert res.begin_write(KEYS[0], 2, gen) is Slot.SUPERSEDED
    levels = res.delete_ready(KEYS[0])
    assert levels == [0, 1, 2]  # the shared level is cleared even though its index lacks the key
    assert res.end_delete(KEYS[0]) == 2
    assert res.locate([KEYS[0]]) == [None] and len(res) == 0


def test_a_probe_that_began_before_a_delete_ended_indexes_nothing():
    res = _res()
    token = res.deletes
    assert res.begin_delete(KEYS[0]) and res.delete_ready(KEYS[0]) is not None
    res.end_delete(KEYS[0])
    assert res.found(2, KEYS[0], UNIT, token) is None
    assert res.found(2, KEYS[0], UNIT, res.deletes) == 0


def test_pinned_copies_are_never_victims():
    res = _res()
    plane = Plane(res, {})
    _put(res, plane, KEYS[0], 2)
    (hold,) = res.pin([KEYS[0]])
    gen = res.next_gen()
    plane.sizes[gen] = UNIT
    assert res.begin_write(KEYS[1], 0, gen) is Slot.OK
    room = res.reserve(KEYS[1], 0, UNIT)
    assert room.reserved is None and not room.victims and room.wait
    res.unpin([hold])
    room = res.reserve(KEYS[1], 0, UNIT)
    assert [v.key for v in room.victims] == [KEYS[0]]


def test_a_pin_release_wakes_a_waiter_for_room_but_not_the_write_back_scheduler():
    """A read pins and releases its copies: that must wake whoever waits for room (a pinned victim), but not
    the write-back scheduler, which never waits for a pin (it woke once per read: a GIL hand-off per get)."""
    import threading
    import time

    res = _res()
    plane = Plane(res, {})
    _put(res, plane, KEYS[0], 2)
    (hold,) = res.pin([KEYS[0]])
    gen = res.next_gen()
    assert res.begin_write(KEYS[1], 0, gen) is Slot.OK
    got, scheduler_woke = [], threading.Event()

    def wait_for_room():
        got.append(res.wait_until(lambda: r if (r := res.reserve(KEYS[1], 0, UNIT)).victims else None, poll=30))

    def scheduler():
        res.wait_for_change(res.changes, timeout=1.0)
        if res.changes != seen:
            scheduler_woke.set()

    seen = res.changes
    threads = [threading.Thread(target=wait_for_room), threading.Thread(target=scheduler)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    res.unpin([hold])
    threads[0].join(5)
    assert got and [v.key for v in got[0].victims] == [KEYS[0]] and time.monotonic() - t0 < 2  # woken, not polled
    threads[1].join(5)
    assert not scheduler_woke.is_set() and res.changes == seen


def test_a_failing_level_backs_off_and_a_flush_grants_it_another_round():
    clock = Clock()
    res = _res(clock=clock)
    plane = Plane(res, {})
    _put(res, plane, KEYS[0])
    for _ in range(res.fast_retries):
        clock.now += res.max_retry_delay + 1
        assert plane.write_back(1, 8, fail=True) == 1
    assert res.take_due(1, 8) == ([], [])  # backing off
    failed, _ = res.losses()
    assert failed == {KEYS[0]: {1}}
    state = res.flush_begin()
    assert not res.flush_settled(state)
    assert plane.write_back(1, 8) == 1
    plane.write_back(2, 8)
    assert res.flush_settled(state) and res.losses() == ({}, {})


def test_enospc_holds_what_is_held_until_a_probe_finds_room():
    clock = Clock()
    res = Residency([LevelSpec("disk", None)], clock=clock)
    res.adopt(0, [(KEYS[0], UNIT)])
    assert res.space_full(0) == res.enospc_recheck
    assert res.begin_write(KEYS[1], 0, res.next_gen()) is Slot.OK
    room = res.reserve(KEYS[1], 0, UNIT)
    assert [v.key for v in room.victims] == [KEYS[0]]  # the newest survive
    clock.now += res.enospc_recheck
    assert res.space_probe_due(0)
    res.space_probed(0, 10 * UNIT)
    res.keep(room.victims[0])
    assert res.reserve(KEYS[1], 0, UNIT).reserved == UNIT


@pytest.mark.parametrize("busy_level", [0, 1])
def test_one_storage_mutation_per_key_and_level(busy_level):
    res = _res()
    g1, g2 = res.next_gen(), res.next_gen()
    assert res.begin_write(KEYS[0], busy_level, g1) is Slot.OK
    assert res.begin_write(KEYS[0], busy_level, g2) is Slot.BUSY
    assert res.begin_write(KEYS[0], 1 - busy_level, g2) is Slot.OK
    res.commit_write(KEYS[0], 1 - busy_level, g2, UNIT, 0, put=True)
    res.abort_write(KEYS[0], busy_level, g1)
    assert res.begin_write(KEYS[0], busy_level, g1) is Slot.SUPERSEDED  # a newer put committed meanwhile


def test_a_newer_chunk_is_never_dropped_in_place_of_an_older_one_being_written_below():
    """While the least recently used chunk is being written below, a put that needs room waits for it rather
    than drop a newer dirty chunk the policy would otherwise give up (the newest chunks are the ones kept)."""
    res = Residency([LevelSpec("host", 2 * UNIT), LevelSpec("remote", None, shared=True)], Pressure.DROP,
                    clock=Clock())
    plane = Plane(res, {})
    for k in KEYS[:2]:
        _put(res, plane, k)
    (in_flight,), _ = res.take_due(1, 1)  # the older chunk's write to the remote is under way
    assert in_flight.key == KEYS[0]
    (failing,), _ = res.take_due(1, 1)  # the newer one's write failed: the remote backs off for it
    res.unpin([Hold(failing.key, failing.source, failing.source_size, failing.gen)])
    res.abort_write(failing.key, 1, failing.gen, failed=True)
    gen = res.next_gen()
    assert res.begin_write(KEYS[2], 0, gen) is Slot.OK
    room = res.reserve(KEYS[2], 0, UNIT)
    assert room.reserved is None and not room.victims and room.wait  # wait for the write under way
    assert res.losses() == ({}, {})
    res.unpin([Hold(in_flight.key, in_flight.source, in_flight.source_size, in_flight.gen)])
    res.abort_write(in_flight.key, 1, in_flight.gen, failed=True)  # it failed too: now the oldest may go
    assert [v.key for v in res.reserve(KEYS[2], 0, UNIT).victims] == [KEYS[0]]
