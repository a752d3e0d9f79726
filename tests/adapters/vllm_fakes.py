"""A fake vLLM driver: the scheduler's and the model runner's calls to a connector, in vLLM's order,
with vLLM-shaped request and scheduler-output objects (no vLLM import)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import torch
from tierstore_vllm.lookup import LookupClient, LookupServer
from tierstore_vllm.options import rank_config, socket_path
from tierstore_vllm.plan import StepPlan
from tierstore_vllm.scheduler import SchedulerSide
from tierstore_vllm.worker import WorkerSide

from tierstore.engines import open_store
from tierstore.kv import KVNamespace

BLOCK, CHUNK, HEADS, DIM, LAYERS, BLOCKS = 16, 32, 2, 8, 2, 64
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)  # grows as the engine decodes

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def block_hashes(self) -> list[bytes]:
        """One hash per full block of the tokens so far, each chained to the one before (as vLLM's)."""
        hashes: list[bytes] = []
        tokens = self.all_token_ids
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            parent = hashes[-1] if hashes else b"none"
            hashes.append(hashlib.sha256(parent + repr(tokens[start:start + BLOCK]).encode()).digest())
        return hashes


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)


def flash_caches(seed: int | None = None) -> dict[str, torch.Tensor]:
    """Per-layer FlashAttention caches ``(2, blocks, block_size, heads, dim)``, random or zero."""
    g = None if seed is None else torch.Generator().manual_seed(seed)
    shape = (2, BLOCKS, BLOCK, HEADS, DIM)
    return {n: (torch.zeros(shape) if g is None else torch.randn(shape, generator=g)).to(torch.bfloat16)
            for n in LAYER_NAMES}


class Engine:
    """One engine instance: ``tp`` worker ranks (each its own store and lookup server) and a scheduler."""

    def __init__(self, root, tiers: list[dict], tp: int = 2, engine_id: str = "e", lookup_timeout_s: float = 1.0,
                 remote_wait_s: float = 5.0, caches_seed: int | None = None, save_memory: int = 1 << 30,
                 layerwise: bool = True):
        self.workers, self.servers, self.caches = [], [], []
        for rank in range(tp):
            store = open_store(rank_config({"tiers": tiers}, rank, tp, 0, 1))
            ns = KVNamespace(model="tiny", dtype="bfloat16", tp_rank=rank, tp_size=tp)
            w = WorkerSide(store, ns, chunk_tokens=CHUNK, block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM,
                           save_memory=save_memory, layerwise=layerwise)
            caches = flash_caches(None if caches_seed is None else caches_seed + rank)
            w.register_kv_caches(caches)
            path = socket_path(str(root / "sock"), engine_id, rank, 0)
            self.servers.append(LookupServer(path, w.answer))
            self.workers.append(w)
            self.caches.append(caches)
        self.client = LookupClient([s.path for s in self.servers])
        self.scheduler = SchedulerSide(self.client.ask, chunk_tokens=CHUNK, block_size=BLOCK,
                                       lookup_timeout_s=lookup_timeout_s, remote_wait_s=remote_wait_s)

    def matched(self, request: Request, num_computed: int = 0, deadline_s: float = 10.0) -> int:
        """``get_num_new_matched_tokens`` as vLLM's scheduler calls it: again each step until not None."""
        end = time.monotonic() + deadline_s
        while True:
            n, is_async = self.scheduler.get_num_new_matched_tokens(request, num_computed)
            assert is_async is False
            if n is not None:
                return n
            assert time.monotonic() < end, "the connector kept answering 'ask again'"
            time.sleep(0.01)

    def step(self, output: SchedulerOutput, drain: bool = True) -> StepPlan:
        """One model-runner step on every rank: start_load_kv, per layer wait/save, wait_for_save; with
        ``drain`` it also waits for the background writes. Returns the step's plan."""
        plan = self.scheduler.build_plan(output)
        for w in self.workers:
            w.bind(plan)
            w.start_load()
            for name in LAYER_NAMES:
                w.wait_for_layer(name)
                w.save_layer(name)
            w.wait_for_save()
        for w in self.workers if drain else ():
            w.drain(timeout=30)
        return plan

    def serve(self, request: Request, block_ids: list[int], num_computed: int = 0) -> int:
        """Schedule ``request`` whole (lookup, alloc, one step); returns the external hit."""
        hit = self.matched(request, num_computed)
        self.scheduler.update_state_after_alloc(request, block_ids, hit)
        done = num_computed + hit
        prompt = request.prompt_token_ids
        self.step(SchedulerOutput([NewRequestData(request.request_id, prompt, (block_ids,), done)],
                                  num_scheduled_tokens={request.request_id: len(prompt) - done}))
        return hit

    def close(self) -> None:
        self.client.close()
        self.scheduler.close()
        for s in self.servers:
            s.close()
        for w in self.workers:
            w.close()
