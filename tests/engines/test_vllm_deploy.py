"""The guide's deployment, steps 3-5, as a user runs it: ``examples/deploy/launch.sh`` starts two vLLM API
servers with the TierstoreConnector and a shared tier, and ``vllm-router`` (round robin) in front of them.
A long-prefix request through the router is computed by one instance and written to the shared tier; the
same request again lands on the other instance, which loads the prefix from the shared tier; both outputs
equal a server's without the connector."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from engine_helpers import ENGINE_TIMEOUT_S, ApiServer, complete, counter, prompt

from tierstore.bench.deploy import CPU_ENGINE_ARGS, Deployment, router_binary
from tierstore.testing.s3 import free_port

pytest.importorskip("vllm")

ENGINE_ARGS = CPU_ENGINE_ARGS + " --max-model-len 1024 --max-num-batched-tokens 1024"
PROMPT = prompt(7, 600)  # two 256-token chunks and a tail


@pytest.fixture(params=["file", "s3"])
def shared(request, tmp_path) -> tuple[str, dict[str, str], Callable[[], list]]:
    """``(SHARED url, extra environment, a function listing the objects on the shared tier)``."""
    if request.param == "file":
        root = tmp_path / "kvcache"
        return f"file://{root}", {}, lambda: sorted(root.rglob("*.tso")) if root.exists() else []
    server = request.getfixturevalue("s3_server")
    bucket = server.new_bucket()
    fs = server.filesystem()
    env = {"S3_ENDPOINT": server.endpoint_url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}

    def objects():
        fs.invalidate_cache()
        return [p for p in fs.find(f"{bucket}/kv") if p.endswith(".tso")]
    return f"s3://{bucket}/kv", env, objects


@contextmanager
def deployed(model: str, env: dict[str, str], state: Path) -> Iterator[Deployment]:
    """``launch.sh`` with ``env`` over the tests' model settings, for the ``with`` body; its logs are printed
    if the body fails, and it must stop cleanly."""
    dep = Deployment({"MODEL": model, "ENGINE_ARGS": ENGINE_ARGS, "HOST_CAPACITY": "64MiB",
                      "DISK_CAPACITY": "256MiB", "VLLM_CPU_KVCACHE_SPACE": "1", **env}, state, ENGINE_TIMEOUT_S)
    try:
        yield dep
    except BaseException:
        print(dep.logs())
        raise
    finally:
        status = dep.close()
    assert status == 0


def through_the_router(tiny_model, tmp_path, env: dict[str, str], chunks_saved: Callable[[Path], int],
                       check_hit: Callable[[Deployment, str, dict[str, float]], None]) -> None:
    """The guide's steps 4-5 with ``launch.sh`` settings ``env``: a long-prefix request through the router, then
    (once ``chunks_saved(state dir)`` counts its two chunks where the other instance can find them) the same
    request again, which round robin sends to the other instance: it must hit, and both outputs equal a server's
    without the connector. ``check_hit(deployment, instance that hit, its hits by labels)`` checks the rest."""
    with ApiServer(tiny_model, free_port(), log=tmp_path / "plain.log") as plain:
        expected = plain.complete(PROMPT, max_tokens=6)["choices"][0]["text"]
    if router_binary() is None:
        pytest.skip("vllm-router is not installed (make engines-venv installs it)")
    state = tmp_path / "deploy"
    with deployed(tiny_model, env, state) as dep:
        first = complete(dep.url("router"), tiny_model, PROMPT, max_tokens=6)
        deadline = time.monotonic() + 60
        while chunks_saved(state) < 2 and time.monotonic() < deadline:  # write-back / save in the background
            time.sleep(0.5)
        assert chunks_saved(state) >= 2, "the first instance's prefix was saved where the other finds it"
        second = complete(dep.url("router"), tiny_model, PROMPT, max_tokens=6)  # round robin: the other instance
        assert first["choices"][0]["text"] == second["choices"][0]["text"] == expected
        hits = {name: counter(dep.url(name), "tierstore_kv_hit_tokens_total") for name in ("a", "b")}
        served = [name for name, h in hits.items() if sum(h.values()) > 0]
        assert len(served) == 1, hits  # one instance computed, the other hit
        check_hit(dep, served[0], hits[served[0]])


def test_the_guides_steps_4_and_5_through_the_router(tiny_model, tmp_path, shared):
    url, env, objects = shared

    def check_hit(dep: Deployment, name: str, hits: dict[str, float]) -> None:
        assert sum(hits.values()) >= 512, hits  # both chunks
        remote_reads = counter(dep.url(name), "tierstore_read_bytes_total")
        assert sum(v for labels, v in remote_reads.items() if 'tier="remote"' in labels) > 0, remote_reads

    through_the_router(tiny_model, tmp_path, {**env, "SHARED": url}, lambda _: len(objects()), check_hit)


def test_two_instances_on_one_node_server_through_the_router(tiny_model, tmp_path):
    """``KV=tierstore-serve``: launch.sh starts one ``tierstore serve`` for the node and both instances use it;
    the prefix the first instance computed is the other's hit from the node's host memory, no shared tier."""
    import tierstore

    def in_node_host(state: Path) -> int:
        with tierstore.open({"server": f"unix://{state}/run/tierstore.sock"}) as node:
            return int(node.stats()["tiers"].get("host", {}).get("objects", 0))

    def check_hit(dep: Deployment, name: str, hits: dict[str, float]) -> None:
        assert sum(v for labels, v in hits.items() if 'tier="host"' in labels) >= 512, hits

    through_the_router(tiny_model, tmp_path, {"KV": "tierstore-serve", "SHARED": "none"}, in_node_host, check_hit)


def test_kv_aware_routing_sends_a_prefix_to_the_instance_whose_tierstore_holds_it(tiny_model, tmp_path):
    """``ROUTER_POLICY=kv_aware``: the instances publish KV events and the router routes on them. With vLLM's own
    prefix cache off, the only events are the chunks tierstore saves (medium CPU). Between two idle instances
    the router has a default; a prefix computed on the other one (asked directly) must draw its next request
    there, and hit (without the events it goes to the default; round robin alternates)."""
    if router_binary() is None:
        pytest.skip("vllm-router is not installed (make engines-venv installs it)")
    env = {"ENGINE_ARGS": ENGINE_ARGS + " --no-enable-prefix-caching", "KV": "tierstore", "SHARED": "none",
           "ROUTER_POLICY": "kv_aware"}
    with deployed(tiny_model, env, tmp_path / "deploy") as dep:

        def served() -> dict[str, float]:
            return {name: sum(counter(dep.url(name), "vllm:request_success_total").values()) for name in ("a", "b")}

        def hit_tokens(name: str) -> float:
            return sum(counter(dep.url(name), "tierstore_kv_hit_tokens_total").values())

        before = served()
        complete(dep.url("router"), tiny_model, prompt(10, 40), max_tokens=2)  # nothing cached anywhere
        after = served()
        (default,) = [n for n in after if after[n] > before[n]]
        other = "b" if default == "a" else "a"
        for seed in (11, 12):
            prefix = prompt(seed, 600)
            complete(dep.url(other), tiny_model, prefix + [1, 2], max_tokens=2)  # computed and saved there
            time.sleep(1.0)  # its event reaches the router
            before, hits = served(), hit_tokens(other)
            complete(dep.url("router"), tiny_model, prefix + [3, 4], max_tokens=2)
            after = served()
            assert (after[other] - before[other], after[default] - before[default]) == (1, 0), (seed, before, after)
            assert hit_tokens(other) >= hits + 512
