"""Load a safetensors checkpoint fast, fill a model in place, and cache an S3 checkpoint on local disk.

Run: python examples/load_weights.py        (no network: writes a small checkpoint, uses a local S3 server
                                             only if moto is installed)
"""

import atexit
import shutil
import tempfile
import time

import torch

import tierstore
import tierstore.weights as tw
from tierstore.weights.synth import write_llm_checkpoint

work = tempfile.mkdtemp(prefix="tierstore-example-")
atexit.register(shutil.rmtree, work, True)  # the checkpoint and the cache are removed when the script ends
ckpt = f"{work}/model"
write_llm_checkpoint(ckpt, 64 << 20, shard_size=24 << 20)  # a small Llama-like model in 3 shards + index

# 1. a dict of tensors (headers validated first, large parallel reads, views over the read buffers)
state = tw.load(ckpt)
print(f"loaded {len(state)} tensors, {sum(t.nbytes for t in state.values()) / 1e6:.0f} MB")

# 2. stream them (each yielded as soon as its bytes are in), a subset, cast to float32
for name, t in tw.iter_tensors(ckpt, names=lambda n: "layers.0." in n, dtype=torch.float32):
    print(f"  {name:45s} {tuple(t.shape)} {t.dtype}")

# 3. fill an existing model's parameters in place (reads land straight in their memory)
params = {n: torch.empty_like(t) for n, t in state.items()}  # e.g. model.state_dict()
tw.load_into(params, ckpt)
assert all(torch.equal(params[n], state[n]) for n in state)

# 4. S3 through the store: the second load is served by the local tiers
try:
    from tierstore.testing.s3 import local_s3
except ImportError:
    raise SystemExit(0) from None
tiers = [{"kind": "host", "capacity": "256MiB"}, {"kind": "disk", "path": f"{work}/cache", "capacity": "1GiB"}]
with local_s3() as s3, tierstore.open({"tiers": tiers}) as store:
    bucket = s3.new_bucket()
    s3.filesystem().put(ckpt + "/", f"{bucket}/model/", recursive=True)
    for attempt in ("first", "second"):
        stats, t0 = {}, time.perf_counter()
        tw.load_into(params, f"s3://{bucket}/model", store=store, storage_options=s3.storage_options, stats=stats)
        print(f"{attempt} S3 load: {time.perf_counter() - t0:.2f} s, {stats['source_reads']} ranged GETs, "
              f"{stats['cache_hits']} ranges from the store")
        store.flush()
