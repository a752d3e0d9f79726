"""The vLLM-free parts of ``TierstoreTier``: its options (checked at engine start-up) and the background probes
of shared tiers (answers at once, one batch per scheduler step, verdicts kept while a request relies on them),
on a real store with a real ``file://`` shared tier. The tier itself is tested against vLLM's real classes in
tests/engines/test_vllm_tier_component.py."""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tierstore_vllm.probes import Probes
from tierstore_vllm.tier_options import TierOptions

import tierstore
from tierstore.errors import ConfigError
from tierstore.keys import ChunkKey


def host(capacity: str = "1MiB") -> dict:
    return {"kind": "host", "capacity": capacity}


def test_options_defaults_and_locality():
    local = TierOptions.parse({"config": {"tiers": [host()]}})
    assert (local.locality, local.io_threads, local.enable_kv_events) == ("LOCAL", 4, False)
    assert not local.through_server
    shared = TierOptions.parse({"config": {"tiers": [host(), {"kind": "remote", "url": "file:///x"}]}})
    assert shared.locality == "REMOTE"
    server = TierOptions.parse({"server": "unix:///run/tierstore.sock", "tenant": "t1", "model_id": "m"})
    assert (server.config, server.locality, server.tenant, server.model_id) == (
        {"server": "unix:///run/tierstore.sock"}, "REMOTE", "t1", "m")


def test_options_read_a_config_file_or_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "tier.yaml"
    path.write_text("tiers:\n  - {kind: disk, path: /tmp/x, capacity: 1GiB}\n")
    assert TierOptions.parse({"config": str(path)}).config["tiers"][0]["kind"] == "disk"
    monkeypatch.setenv("TIERSTORE_CONFIG", str(path))
    assert TierOptions.parse({}).config["tiers"][0]["kind"] == "disk"


@pytest.mark.parametrize("options,error", [
    ({"config": {"tiers": [host()]}, "cpu_bytes": 1}, r"unknown option\(s\) \['cpu_bytes'\]"),
    ({"config": {"tiers": []}}, r"'tiers' names no local \(host, disk\) or shared \(remote\) tier"),
    ({"config": {"write_policy": "write_back"}}, "names no local"),
    ({"config": {"tiers": [host()]}, "server": "unix:///s"}, "not both"),
    ({"server": "http://x"}, r"server must be a 'unix:///"),
    ({"config": {"tiers": [host()]}, "locality": "NEAR"}, "locality must be"),
    ({"config": {"tiers": [host()]}, "enable_kv_events": "yes"}, "enable_kv_events must be"),
    ({"config": {"tiers": [host()]}, "io_threads": 0}, r"io_threads must be an int in \[1, 64\]"),
    ({"config": {"tiers": [host()]}, "tenant": ""}, "tenant must be a non-empty string"),
    ({"config": "/nonexistent/tier.yaml"}, "cannot be read"),
])
def test_bad_options_raise_config_error_naming_the_key(options, error, monkeypatch):
    monkeypatch.delenv("TIERSTORE_CONFIG", raising=False)
    with pytest.raises(ConfigError, match=error) as info:
        TierOptions.parse(options)
    assert isinstance(info.value, ValueError)


def test_no_config_and_no_environment_is_an_error(monkeypatch):
    monkeypatch.delenv("TIERSTORE_CONFIG", raising=False)
    with pytest.raises(ConfigError, match="needs 'config'"):
        TierOptions.parse({})


# ---------------------------------------------------------------------------------------------- probes
def chunk(i: int) -> ChunkKey:
    return ChunkKey.chain(None, b"probes", i.to_bytes(4, "big"))


def settle(probes: Probes, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while probes.busy:
        assert time.monotonic() < deadline
        time.sleep(0.005)
        probes.drain()


@pytest.fixture
def shared_and_probes(tmp_path):
    """A chunk written to a ``file://`` tier by one store, probes of another store (which has never listed it)."""
    url = f"file://{tmp_path / 'shared'}"
    with tierstore.open({"tiers": [{"kind": "remote", "url": url}]}) as writer:
        assert writer.put(chunk(1), {"kv": torch.arange(16, dtype=torch.int8)})
        writer.flush()
    reader = tierstore.open({"tiers": [host(), {"kind": "remote", "url": url}]})
    pool = ThreadPoolExecutor(2)
    yield reader, Probes(reader.contains_many, pool)
    pool.shutdown()
    reader.close()


def test_a_probe_answers_after_one_step_and_the_verdict_stays_while_asked(shared_and_probes):
    store, probes = shared_and_probes
    assert probes.verdict(b"k1", "r1") is None
    probes.ask(b"k1", chunk(1), "r1")
    probes.ask(b"k2", chunk(2), "r1")
    assert probes.busy and probes.verdict(b"k1", "r1") is None  # queued until the step ends
    probes.flush()
    settle(probes)
    assert (probes.verdict(b"k1", "r1"), probes.verdict(b"k2", "r1")) == (True, False)
    assert probes.verdict(b"k2", "r2") is False  # another request shares the verdict
    probes.release("r1")
    assert probes.verdict(b"k2", "r2") is False
    probes.release("r2")
    assert probes.verdict(b"k1", "r3") is None and probes.verdict(b"k2", "r3") is None  # forgotten
    probes.settle([b"k1"], False)  # nothing to settle: no error


def test_a_failed_load_or_a_store_of_our_own_settles_the_verdict(shared_and_probes):
    _, probes = shared_and_probes
    probes.ask(b"k1", chunk(1), "r1")
    probes.flush()
    settle(probes)
    assert probes.verdict(b"k1", "r1") is True
    probes.settle([b"k1"], False)
    assert probes.verdict(b"k1", "r1") is False
    probes.settle([b"k1"], True)  # this engine stored it again
    assert probes.verdict(b"k1", "r1") is True


def test_a_request_finishing_while_its_probe_is_in_flight_leaves_nothing_behind():
    gate = threading.Event()

    def ask(keys):
        gate.wait(10)
        return [True] * len(keys)

    with ThreadPoolExecutor(1) as pool:
        probes = Probes(ask, pool)
        probes.ask(b"k", chunk(3), "r1")
        probes.flush()
        probes.release("r1")  # in flight: kept until its result lands
        assert probes.busy
        gate.set()
        settle(probes)
        assert probes.verdict(b"k", "r2") is None and not probes._states


def test_a_probe_that_raises_is_a_miss():
    def ask(keys):
        raise OSError("shared tier unreachable")

    with ThreadPoolExecutor(1) as pool:
        probes = Probes(ask, pool)
        probes.ask(b"k", chunk(4), "r1")
        probes.flush()
        settle(probes)
        assert probes.verdict(b"k", "r1") is False


def test_many_requests_and_steps_under_thread_switching(shared_and_probes):
    """The scheduler's thread asks, flushes and releases while the pool answers, with the GIL switching as
    often as it can: every asked key ends with the right verdict, and nothing is left once all finished."""
    store, probes = shared_and_probes
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for step in range(50):
            for r in range(4):
                req = f"r{step}-{r}"
                for i in range(3):
                    key = f"k{(step + r + i) % 7}".encode()
                    if probes.verdict(key, req) is None and key not in probes._states:
                        probes.ask(key, chunk(1 if key == b"k1" else 100 + i), req)
            probes.flush()
            if step % 3 == 0:
                for r in range(4):
                    probes.release(f"r{step - 3}-{r}")
        settle(probes)
        assert probes.verdict(b"k1", "final") is True
        for step in range(50):
            for r in range(4):
                probes.release(f"r{step}-{r}")
        probes.release("final")
        assert not probes._states and not probes._by_request
    finally:
        sys.setswitchinterval(old)
