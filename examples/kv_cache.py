"""Reuse a prompt's KV cache instead of recomputing it: save after prefill, load, continue.

Run: ``python examples/kv_cache.py`` (a store in a temp dir; a second engine instance reopens it).
"""

import tempfile

import torch

import tierstore
from tierstore.models import TinyDecoder

model = TinyDecoder()  # a small Llama-style decoder with random weights (float32, CPU)
ns = tierstore.KVNamespace(**model.namespace_fields())  # model, revision, dtype: keys never mix models
prompt = torch.randint(0, model.config.vocab_size, (700,), generator=torch.Generator().manual_seed(0))

with tempfile.TemporaryDirectory() as tmp:
    config = {"tiers": [{"kind": "host", "capacity": "256MiB"},
                        {"kind": "disk", "path": f"{tmp}/disk", "capacity": "1GiB"}]}

    # engine instance A: prefill the conversation so far and save its KV (full 256-token chunks)
    with tierstore.open(config) as store:
        kv = tierstore.KVCacheStore(store, ns, chunk_tokens=256)
        first = model.prefill(prompt[:600])
        kv.save(prompt[:600], first.kv)  # one (2, tokens, kv_heads, head_dim) tensor per layer

    # engine instance B (fresh host tier, same disk): the longer follow-up prompt reuses 512 tokens
    with tierstore.open(config) as store:
        kv = tierstore.KVCacheStore(store, ns, chunk_tokens=256)
        hit = kv.lookup(prompt)
        print(f"{hit} of {len(prompt)} tokens cached, per chunk in tier: {kv.where(prompt[:hit])}")
        past = kv.load(prompt, hit)  # retain policy: the chunks are now in the host tier too
        logits = model.prefill(prompt[hit:], past).logits

    same_split = model.prefill(prompt[hit:], [t[:, :hit] for t in first.kv]).logits
    full = model.prefill(prompt).logits[hit:]
    print("bit-identical to the same split without the store:", torch.equal(logits, same_split))
    print(f"max |logit difference| vs full recompute: {(logits - full).abs().max().item():.1e}")
