"""Run by tests/test_store_processes.py in a separate OS process.

    python store_worker.py CONFIG_JSON ROLE FIRST COUNT

ROLE ``publish`` puts chunks FIRST..FIRST+COUNT-1 and flushes; ROLE ``read`` waits (up to 60 s) until
it sees them all through the store and checks every byte. Prints one JSON line with what it did.
"""

import json
import sys
import time

import tierstore
from tierstore.testing.data import chunk, key_of


def main() -> int:
    config, role, first, count = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    keys = [key_of(i) for i in range(first, first + count)]
    with tierstore.open(config) as store:
        if role == "publish":
            for i, k in zip(range(first, first + count), keys, strict=True):
                store.put(k, chunk(i, 16384))
            store.flush()
            print(json.dumps({"published": count}))
            return 0
        deadline = time.monotonic() + 60
        while store.lookup(keys) < count:
            if time.monotonic() > deadline:
                print(json.dumps({"seen": store.lookup(keys)}))
                return 1
            time.sleep(0.05)
        tiers, retried = set(), 0
        for i, k in zip(range(first, first + count), keys, strict=True):
            expected = chunk(i, 16384)
            for _ in range(10):  # a miss is allowed (a degraded remote), wrong data never is
                got = store.get(k)
                if got is not None:
                    break
                retried += 1
                time.sleep(0.2)
            if got is None or any(not got[n].equal(expected[n]) for n in expected):
                print(json.dumps({"bad": i, "miss": got is None, "stats": store.stats()}))
                return 1
        for k in keys:
            tiers.add(store.where(k))
        print(json.dumps({"verified": count, "tiers": sorted(tiers), "retried": retried}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
