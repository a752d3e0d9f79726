"""A shared prefix kept within its budget from listings alone (issue 21): the plan's rules as properties,
gc of a real S3 prefix (through the request-counting shim) and of a ``file://`` prefix without reading one
object, last use refreshed about once per object per interval across readers, readers that find an object
gone get a miss, two gc at once, and gc --watch beside live writer processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tierstore
from tierstore.keys import ChunkKey
from tierstore.tiers.layout import object_relpath
from tierstore.tiers.prefix_gc import Entry, plan
from tierstore.tiers.remote import RemoteTier

NOW = 1_000_000.0
SIZE = 1024  # payload bytes per chunk


# ---------------------------------------------------------------------- the plan, as properties
entries = st.lists(st.tuples(st.integers(1, 5000), st.floats(0, 20_000), st.booleans()), max_size=60)


def _entries(raw) -> list[Entry]:
    return [Entry(f"p/{i}", size, NOW - age, None if temp else ChunkKey.from_bytes(b"%d" % i))
            for i, (size, age, temp) in enumerate(raw)]


@settings(max_examples=300, deadline=None)
@given(raw=entries, budget=st.integers(0, 100_000), grace=st.floats(0, 5000), older=st.none() | st.floats(0, 15_000),
       stale=st.floats(0, 10_000))
def test_the_plan_keeps_the_budget_the_grace_period_and_lru_order(raw, budget, grace, older, stale):
    es = _entries(raw)
    p = plan(es, NOW, max_size=budget, older_than=older, grace=grace, stale_after=stale)
    removed = {e.path for e in p.remove}
    for e in p.remove:
        assert NOW - e.last_use > grace  # nothing within the grace period, ever
        if e.key is None:
            assert NOW - e.last_use > stale
    kept = [e for e in es if e.key is not None and e.path not in removed]
    assert p.bytes_after == sum(e.size for e in kept)
    assert p.bytes_after <= budget or p.protected > 0  # over budget only by what the grace period protects
    if older is not None:
        assert all(NOW - e.last_use <= max(older, grace) for e in kept)
    if older is None:  # the budget alone: every removed object was used before every kept, evictable one
        evictable = [e for e in kept if NOW - e.last_use > grace]
        for e in p.remove:
            if e.key is not None:
                assert all(e.last_use <= k.last_use for k in evictable)


def test_the_plan_removes_temp_files_only_when_stale():
    es = [Entry("a.tmp", 10, NOW - 4000), Entry("b.tmp", 10, NOW - 100),
          Entry("o", 10, NOW - 4000, ChunkKey.from_bytes(b"o"))]
    p = plan(es, NOW, stale_after=3600, grace=600)
    assert [e.path for e in p.remove] == ["a.tmp"] and p.bytes_after == 10 and p.objects == 1


# ---------------------------------------------------------------------- helpers for real prefixes
def key(i: int) -> ChunkKey:
    return ChunkKey.from_bytes(b"gc-%d" % i)


def value(i: int) -> dict[str, torch.Tensor]:
    return {"x": torch.full((SIZE // 4,), float(i))}


def age_objects(root: Path, ages: dict[int, float]) -> None:
    """Set the mtime of key i's object under a ``file://`` root to ``ages[i]`` seconds ago."""
    now = time.time()
    for i, age in ages.items():
        path = root / object_relpath(key(i))
        os.utime(path, (now - age, now - age))


# ---------------------------------------------------------------------- S3: listings only
def test_gc_of_an_s3_prefix_reads_no_object_and_lists_once_per_thousand(s3_bucket, s3_server, shim):
    n = 1200  # two LIST pages
    opts = shim.storage_options(s3_server.storage_options)
    url = f"s3://{s3_bucket}/kv"
    with RemoteTier(url=url, storage_options=opts, list_on_open=False, touch_after=None) as writer:
        items = [(key(i), value(i)) for i in range(n)]
        for start in range(0, n, 300):
            assert all(writer.put_many(items[start:start + 300]))
    with RemoteTier(url=url, storage_options=opts, list_on_open=False) as tier:
        shim.reset()
        done = tier.collect_garbage(max_size=0, grace=3600)  # everything is younger than the grace period
        stats = shim.stats()
        assert sum(stats["gets"].values()) == 0 and stats["bulk_deletes"] == 0
        assert stats["lists"] == -(-n // 1000)  # one LIST per 1,000 objects
        assert done.objects == n and done.removed_objects == 0 and done.protected == n
        shim.reset()
        budget = done.bytes // 2
        done = tier.collect_garbage(max_size=budget, grace=0)
        stats = shim.stats()
    assert sum(stats["gets"].values()) == 0  # not one object body read
    assert stats["lists"] == -(-n // 1000)
    assert stats["bulk_deletes"] == -(-done.removed_objects // 1000)  # batched: 1,000 keys per request
    assert done.bytes_after <= budget and done.removed_objects >= n // 2 - 1
    with RemoteTier(url=url, storage_options=opts) as check:
        assert len(check) == n - done.removed_objects


# ---------------------------------------------------------------------- file://: listings only, LRU
def test_gc_of_a_file_prefix_reads_no_object_file_and_keeps_the_recently_used(tmp_path, monkeypatch):
    root = tmp_path / "shared"
    with RemoteTier(url=root.as_uri()) as tier:
        assert all(tier.put_many([(key(i), value(i)) for i in range(10)]))
        size = tier.stats()["used_bytes"] // 10
    age_objects(root, {i: 10_000 - 100 * i for i in range(10)})  # key 9 used most recently
    # a gc that opened one object would fail here
    import tierstore.tiers.objfile as objfile

    def no_reads(*a, **k):
        raise AssertionError("gc read an object")

    monkeypatch.setattr(objfile, "open_object", no_reads)
    with RemoteTier(url=root.as_uri(), list_on_open=False) as tier:
        monkeypatch.setattr(tier.fs, "cat_file", no_reads)
        monkeypatch.setattr(tier.fs, "open", no_reads)
        done = tier.collect_garbage(max_size=4 * size, grace=600)
    assert done.removed_objects == 6 and done.bytes_after == 4 * size
    left = sorted(int(p.stem.split(".")[0], 16) for p in root.rglob("*.tso"))
    assert len(left) == 4
    monkeypatch.undo()
    with RemoteTier(url=root.as_uri()) as tier:
        assert [i for i in range(10) if tier.contains(key(i))] == [6, 7, 8, 9]  # the four most recently used


def test_a_read_refreshes_last_use_about_once_per_interval_across_readers(s3_bucket, s3_server, shim):
    opts = shim.storage_options(s3_server.storage_options)
    url = f"s3://{s3_bucket}/kv"
    readers = [RemoteTier(url=url, storage_options=opts, touch_after=1.0) for _ in range(3)]
    try:
        assert readers[0].put(key(1), value(1))
        time.sleep(1.2)  # the object is now older than touch_after
        shim.reset()
        for _ in range(5):
            for r in readers:
                assert torch.equal(r.get(key(1))["x"], value(1)["x"])
                time.sleep(0.05)
        time.sleep(0.5)  # refreshes run in the background
        copies = shim.stats()["copies"]
        # the first reader refreshes it; the others see the new Last-Modified on their next GET
        assert 1 <= copies <= 3, copies
        assert sum(r.stats()["touches"] for r in readers) == copies
    finally:
        for r in readers:
            r.close()


def test_a_used_object_outlives_an_unused_younger_one(tmp_path):
    root = tmp_path / "shared"
    with RemoteTier(url=root.as_uri(), touch_after=60) as tier:
        assert all(tier.put_many([(key(0), value(0)), (key(1), value(1))]))
        age_objects(root, {0: 7200, 1: 3600})  # key 0 written long ago (a system prompt), key 1 later
        assert torch.equal(tier.get(key(0))["x"], value(0)["x"])  # ... but key 0 is still being read
        deadline = time.monotonic() + 5
        while tier.stats()["touches"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        size = tier.stats()["used_bytes"] // 2
        done = tier.collect_garbage(max_size=size, grace=600)
    assert done.removed_objects == 1
    assert (root / object_relpath(key(0))).exists() and not (root / object_relpath(key(1))).exists()


def test_a_reader_whose_object_was_collected_gets_a_miss(tmp_path):
    cfg = {"tiers": [{"kind": "remote", "url": (tmp_path / "shared").as_uri()}]}
    with tierstore.open(cfg) as writer:
        assert all(writer.put_many([(key(i), value(i)) for i in range(5)]))
    with tierstore.open(cfg) as reader:  # listed all five at open
        assert reader.contains_many([key(i) for i in range(5)]) == [True] * 5
        with RemoteTier(url=(tmp_path / "shared").as_uri()) as gc:
            assert gc.collect_garbage(max_size=0, grace=0).removed_objects == 5
        assert reader.get_many([key(i) for i in range(5)]) == [None] * 5  # misses, never an exception
        assert reader.lookup([key(0)]) == 0


def test_two_gc_at_once_do_no_harm(tmp_path):
    root = tmp_path / "shared"
    with RemoteTier(url=root.as_uri()) as tier:
        assert all(tier.put_many([(key(i), value(i)) for i in range(200)]))
        size = tier.stats()["used_bytes"] // 200
    results, errors = [], []

    def run():
        try:
            with RemoteTier(url=root.as_uri(), list_on_open=False) as t:
                results.append(t.collect_garbage(max_size=50 * size, grace=0))
        except Exception as exc:  # pragma: no cover - the assertion below names it
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 2
    assert 0 < len(list(root.rglob("*.tso"))) <= 50


def test_stale_publish_temp_files_go_too(tmp_path):
    root = tmp_path / "shared"
    with RemoteTier(url=root.as_uri()) as tier:
        assert tier.put(key(0), value(0))
    stale = root / ".publish-abc123"
    fresh = root / "model" / ".publish-def456"
    fresh.parent.mkdir()
    stale.write_bytes(b"killed publish")
    fresh.write_bytes(b"publishing now")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    with RemoteTier(url=root.as_uri(), list_on_open=False) as tier:
        done = tier.collect_garbage(grace=600, stale_after=3600)
    assert done.removed_temp == 1 and not stale.exists() and fresh.exists()
    assert (root / object_relpath(key(0))).exists()


def test_bad_arguments_are_clear_errors(tmp_path):
    with RemoteTier(url=(tmp_path / "s").as_uri()) as tier:
        for kw in ({"max_size": -1}, {"max_size": "1GiB"}, {"older_than": -5}, {"grace": float("nan")}):
            with pytest.raises(tierstore.InvalidInputError):
                tier.collect_garbage(**kw)


# ---------------------------------------------------------------------- gc --watch beside live writers
_WRITER = r"""
import sys, time, random, torch, tierstore
from tierstore.keys import ChunkKey
url, seed, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
rng = random.Random(seed)
store = tierstore.open({"tiers": [{"kind": "host", "capacity": "4MiB"},
                                  {"kind": "remote", "url": url, "touch_after": 1.0}],
                        "write_policy": "write_through", "prefetch_policy": "transient"})
end = time.monotonic() + seconds
puts = wrong = 0
while time.monotonic() < end:
    i = rng.randrange(400)
    k = ChunkKey.from_bytes(b"watch-%d" % i)
    got = store.get(k)
    if got is not None and not torch.equal(got["x"], torch.full((256,), float(i))):
        wrong += 1
    if got is None:
        store.put(k, {"x": torch.full((256,), float(i))})
        puts += 1
    time.sleep(0.002)
store.close()
print(f"puts={puts} wrong={wrong}")
"""


@pytest.mark.slow
def test_gc_watch_keeps_a_live_prefix_within_budget(tmp_path):
    root = tmp_path / "shared"
    cfg = tmp_path / "gc.json"
    cfg.write_text(json.dumps({"tiers": [{"kind": "remote", "url": root.as_uri()}]}))
    budget = 150 * 1024  # ~100 of the 400 keys' objects
    env = {**os.environ, "PYTHONPATH": str(Path(tierstore.__file__).resolve().parents[1])}
    prom = tmp_path / "gc.prom"
    gc = subprocess.Popen([sys.executable, "-m", "tierstore.cli", "gc", "--config", str(cfg), "--max-size",
                           str(budget), "--grace", "1", "--watch", "0.5", "--prometheus", str(prom)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, root.as_uri(), str(s), "12"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for s in range(4)]
    sizes = []
    try:
        for w in writers:
            out, err = w.communicate(timeout=120)
            assert w.returncode == 0, err[-3000:]
            assert "wrong=0" in out, out
        time.sleep(2.0)  # one more gc pass after the last write
        sizes.append(sum(p.stat().st_size for p in root.rglob("*.tso")))
    finally:
        gc.terminate()
        _, gc_err = gc.communicate(timeout=30)
    assert "Traceback" not in gc_err, gc_err[-3000:]
    assert sizes[-1] <= 1.1 * budget, (sizes, budget)
    from prometheus_client.parser import text_string_to_metric_families

    gauges = {s.name: s.value for f in text_string_to_metric_families(prom.read_text()) for s in f.samples}
    assert gauges["tierstore_gc_bytes_after"] <= 1.1 * budget and gauges["tierstore_gc_objects"] > 0
