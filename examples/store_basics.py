"""Store and reload tensors through host, disk and a shared-directory remote tier.

    python examples/store_basics.py
"""

import tempfile

import torch

import tierstore

with tempfile.TemporaryDirectory() as tmp:
    config = {
        "tiers": [
            {"kind": "host", "capacity": "64MiB"},
            {"kind": "disk", "path": f"{tmp}/disk", "capacity": "1GiB"},
            {"kind": "remote", "url": f"file://{tmp}/shared", "compression": "zstd"},
        ],
        "write_policy": "write_back",
        "prefetch_policy": "retain",
    }
    tensors = {"k": torch.randn(256, 8, 64), "v": torch.randn(256, 8, 64)}
    key = tierstore.ChunkKey.from_tensors(tensors)

    with tierstore.open(config) as store:
        store.put(key, tensors)      # returns once the host tier holds it
        store.flush()                # ...and now disk and remote have it too
        print("after put:", store.where(key))

    # A new process (or node) with an empty host tier: the chunk comes back from disk, exactly.
    with tierstore.open(config) as store:
        print("after reopen:", store.where(key))
        got = store.get(key)
        assert all(torch.equal(got[n], tensors[n]) for n in tensors)
        print("after get (retain promotes):", store.where(key))
        for name, t in store.stats()["tiers"].items():
            print(f"  {name:<7} objects={t['objects']} used={t['used_bytes']} hits={t['hits']} misses={t['misses']}")
