"""Run one vLLM engine in this (fresh) process and print its greedy outputs as JSON on the last line.

``python engine_run.py '<json spec>'`` with spec keys: ``model``, ``prompts`` (lists of token ids),
``max_tokens``, ``kv`` (the ``kv_transfer_config`` dict or null), ``kv_events`` (a ZMQ endpoint to publish
KV events on), ``load_format``, ``loader_extra``,
``inprocess`` (true: scheduler and worker in this process). The tests start it with ``subprocess`` so
every engine is a new process, as a second serving instance would be.
"""

from __future__ import annotations

import json
import os
import sys


def main(spec: dict) -> dict:
    if spec.get("inprocess", True):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=spec["model"], enforce_eager=True, max_model_len=1024, dtype="bfloat16",
                  max_num_seqs=4, max_num_batched_tokens=1024, seed=0,
                  gpu_memory_utilization=0.15)
    if spec.get("inprocess", True):
        kwargs["distributed_executor_backend"] = "uni"
    if spec.get("kv"):
        kwargs["kv_transfer_config"] = spec["kv"]
    if spec.get("kv_events"):  # publish vLLM's KV events (and the connector's) on this ZMQ endpoint
        kwargs["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                      "endpoint": spec["kv_events"]}
    if spec.get("load_format"):
        kwargs["load_format"] = spec["load_format"]
        kwargs["model_loader_extra_config"] = spec.get("loader_extra") or {}
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0, ignore_eos=True)
    results = []
    for ids in spec["prompts"]:  # one at a time: a later prompt may hit what an earlier one saved
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        results.append({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0})
        if spec.get("reset_between"):
            _reset_prefix_cache(llm)
    return {"results": results, "pid": os.getpid()}


def _reset_prefix_cache(llm) -> None:
    """Drop vLLM's own prefix cache so a later hit can only come from the connector."""
    for _ in range(20):
        if llm.reset_prefix_cache():
            return
        llm.llm_engine.step()
    raise RuntimeError("vLLM did not reset its prefix cache")


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    sys.stdout.flush()
    print("\nRESULT " + json.dumps(result), flush=True)
