"""Run by tests/test_gc_soak.py in a separate OS process: one instance of a fleet sharing a prefix.

    python gc_soak_worker.py CONFIG_JSON SEED SECONDS HOT KEYS RATE LOG

For SECONDS it reads chunks at RATE per second: half of the reads go to the HOT keys (a shared system
prompt: every instance keeps them in its host tier), the rest to the other KEYS - HOT uniformly. A miss
puts the chunk (write-through: on the shared prefix when ``put`` returns). Every use (a hit or a put) is
appended to LOG as ``<epoch seconds> <key index>``; a wrong value is counted. Any exception ends the
process with a traceback (the test fails). Prints one JSON line: ops, hits, puts, wrong.
"""

import json
import random
import sys
import time

import tierstore
from tierstore.testing.data import chunk, key_of

CHUNK_BYTES = 4096


def main() -> int:
    config, seed, seconds = json.loads(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    hot, n_keys, rate, log_path = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]), sys.argv[7]
    rng = random.Random(seed)
    keys = [key_of(i) for i in range(n_keys)]
    counts = {"ops": 0, "hits": 0, "puts": 0, "wrong": 0}
    with tierstore.open(config) as store, open(log_path, "w", buffering=1) as log:
        start = time.monotonic()
        while time.monotonic() < start + seconds:
            i = rng.randrange(hot) if rng.random() < 0.5 else rng.randrange(hot, n_keys)
            expected = chunk(i, CHUNK_BYTES)
            got = store.get(keys[i])
            used = False
            if got is None:
                used = store.put(keys[i], expected)
                counts["puts"] += used
            elif any(not got[n].equal(expected[n]) for n in expected):
                counts["wrong"] += 1
            else:
                used = True
                counts["hits"] += 1
            if used:
                log.write(f"{time.time():.6f} {i}\n")
            counts["ops"] += 1
            time.sleep(max(0.0, start + counts["ops"] / rate - time.monotonic()))
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
