"""One engine instance for the cross-process KV tests (run as ``python tests/kv_worker.py '<json>'``).

``save``: prefill a prompt prefix with the tiny model, save its KV, close the store (write-back reaches
the shared remote tier), print the saved KV's digest. ``load``: look the prompt up, report the tier of
each hit, load the KV, continue the prompt from it and compare with the same split computed without the
store (bit-identical) and a full recompute (tolerance); probe other namespaces. Prints one JSON line.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch

import tierstore
from tierstore import KVCacheStore, KVNamespace
from tierstore.models import TinyConfig, TinyDecoder

CFG = TinyConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, seed=11)
CHUNK = 16


def digest(layers) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in layers:
        h.update(str(tuple(t.shape)).encode() + str(t.dtype).encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(spec: dict) -> dict:
    torch.set_num_threads(1)
    dtype = getattr(torch, spec["dtype"])
    model = TinyDecoder(CFG, dtype=dtype)
    ns = KVNamespace(**model.namespace_fields(), tp_rank=spec.get("tp_rank", 0), tp_size=2,
                     tenant=spec.get("tenant"))
    prompt = torch.randint(0, CFG.vocab_size, (spec["prompt_len"],),
                           generator=torch.Generator().manual_seed(spec["seed"]))
    with tierstore.open(spec["config"]) as store:
        kv = KVCacheStore(store, ns, chunk_tokens=CHUNK)
        if spec["mode"] == "save":
            n = spec["prefix_len"]
            stored = n - n % CHUNK
            # the stored chunks are computed exactly as B's reference computes them (same matmul shapes),
            # then the partial tail is continued; its KV goes to save() but is not stored
            head = model.prefill(prompt[:stored]).kv
            layers = model.prefill(prompt[stored:n], head).kv
            written = kv.save(prompt[:n], layers)
            return {"written": written, "digest": digest([t[:, :stored] for t in layers]),
                    "keys": [k.hex() for k in kv.keys(prompt[:n])], "pid": os.getpid()}
        hit = kv.lookup(prompt)
        tiers = kv.where(prompt[:hit])
        loaded = kv.load(prompt, hit)
        with_store = model.prefill(prompt[hit:], loaded).logits
        reference_kv = model.prefill(prompt[:hit]).kv
        without_store = model.prefill(prompt[hit:], reference_kv).logits
        full = model.prefill(prompt).logits[hit:]
        others = {
            "model": KVNamespace(**{**model.namespace_fields(), "model": "other"}, tp_size=2),
            "dtype": ns.replace(dtype="float16"),
            "rank": ns.replace(tp_rank=1 - ns.tp_rank),
            "tenant": ns.replace(tenant="someone-else"),
        }
        return {
            "hit": hit, "tiers": tiers, "digest": digest(loaded), "pid": os.getpid(),
            "keys": [k.hex() for k in kv.keys(prompt[:hit])],
            "kv_equal": all(torch.equal(a, b) for a, b in zip(loaded, reference_kv, strict=True)),
            "logits_equal": torch.equal(with_store, without_store),
            "max_abs_diff_vs_full": (with_store - full).abs().max().item(),
            "other_hits": {name: KVCacheStore(store, o, chunk_tokens=CHUNK).lookup(prompt)
                           for name, o in others.items()},
            "hashseed": os.environ.get("PYTHONHASHSEED"),
        }


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
