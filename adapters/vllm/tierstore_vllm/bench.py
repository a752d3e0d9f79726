"""``tierstore bench vllm``: multi-round-chat TTFT of real vLLM engines with and without tierstore.

Conversations share a system prompt; each round sends the whole history plus a new user message. TTFT
is the wall time of a one-token generate (prefill + first token), one request at a time. The assistant
turns appended to the history are random tokens: only their length matters for prefill time. Every
configuration runs in a fresh engine process, so nothing is shared between them except the disk tier
the "restart" row reuses:

* ``vllm``: no prefix cache of any kind (every round recomputes its history);
* ``vllm prefix-cache``: vLLM's own prefix cache (in engine memory, lost on restart);
* ``vllm + tierstore``: TierstoreConnector with host + disk tiers, vLLM's prefix cache off;
* ``vllm + tierstore restart``: a new engine on the same disk directory (host tier empty).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tierstore.bench.common import Report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--user-tokens", type=int, default=128)
    p.add_argument("--answer-tokens", type=int, default=128)
    p.add_argument("--workdir", default=None, help="model and disk tier directory (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the results here")


def build_llama(path: str | Path, *, hidden: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                intermediate: int = 256, vocab: int = 1024, seed: int = 0) -> Path:
    """A random-weight Llama (tied embeddings, bfloat16) and a small byte-level BPE tokenizer, offline."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["tierstore keeps KV caches in tiers: device, host, disk and remote. " * 8], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=hidden // heads, max_position_embeddings=8192, bos_token_id=0, eos_token_id=1,
                         tie_word_embeddings=True, initializer_range=0.5, torch_dtype="bfloat16")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def conversations(args: argparse.Namespace) -> list[list[list[int]]]:
    """Per conversation, the prompt of each round (shared system prompt, growing history)."""
    rng = random.Random(0)
    system = [rng.randrange(2, 1000) for _ in range(args.system_tokens)]
    chats = []
    for _ in range(args.conversations):
        history, prompts = list(system), []
        for _ in range(args.rounds):
            history += [rng.randrange(2, 1000) for _ in range(args.user_tokens)]
            prompts.append(list(history))
            history += [rng.randrange(2, 1000) for _ in range(args.answer_tokens)]
        chats.append(prompts)
    return chats


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """In this process: start the engine, send the rounds (conversations interleaved), time each."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = dict(model=spec["model"], enforce_eager=True, max_model_len=8192, dtype="bfloat16",
                                  max_num_seqs=4, max_num_batched_tokens=8192, gpu_memory_utilization=0.15,
                                  distributed_executor_backend="uni", enable_prefix_caching=spec["prefix_cache"])
    if spec.get("kv"):
        kwargs["kv_transfer_config"] = spec["kv"]
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=1, temperature=0)
    chats = spec["chats"]
    ttft: list[tuple[int, float, int]] = []
    llm.generate([TokensPrompt(prompt_token_ids=[5] * 16)], params, use_tqdm=False)  # warm-up
    for r in range(len(chats[0])):
        for chat in chats:
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=chat[r])], params, use_tqdm=False)[0]
            ttft.append((r, time.perf_counter() - t0, out.num_cached_tokens or 0))
    return {"ttft": ttft}


def spawn_engine(spec: dict[str, Any], module: str = "tierstore_vllm.bench") -> dict[str, Any]:
    """``python -m module --engine <spec>`` in a fresh process: its ``RESULT`` line."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    proc = subprocess.run([sys.executable, "-m", module, "--engine", json.dumps(spec)],
                          env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError("engine run failed:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-40:]))
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    return result


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(args: argparse.Namespace) -> int:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tierstore-bench-vllm-"))
    model = work / "llama"
    if not (model / "config.json").exists():
        build_llama(model, hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=2816)
    chats = conversations(args)
    tiers = [{"kind": "host", "capacity": "2GiB"}, {"kind": "disk", "path": str(work / "disk"), "capacity": "8GiB"}]
    kv = {"kv_connector": "TierstoreConnector", "kv_connector_module_path": "tierstore_vllm", "kv_role": "kv_both",
          "kv_connector_extra_config": {"config": {"tiers": tiers}}}
    configs = [("vllm", False, None), ("vllm prefix-cache", True, None), ("vllm + tierstore", False, kv),
               ("vllm + tierstore restart", False, kv)]
    report = Report(f"vLLM multi-round chat TTFT: {args.conversations} conversations x {args.rounds} rounds, "
                    f"system {args.system_tokens} + {args.user_tokens} user + {args.answer_tokens} answer tokens/round")
    base = None
    for name, prefix_cache, kv_config in configs:
        res = spawn_engine({"model": str(model), "chats": chats, "prefix_cache": prefix_cache, "kv": kv_config})
        later = [t for r, t, _ in res["ttft"] if r > 0]
        cached = sum(c for _, _, c in res["ttft"])
        p50 = report.add(f"{name}: TTFT P50, rounds 2+", statistics.median(later), "s",
                         baseline=base, higher_is_better=False, note=f"{cached} cached prompt tokens in all")
        report.add(f"{name}: TTFT P90, rounds 2+", _pct(later, 0.9), "s")
        report.add(f"{name}: TTFT P50, all rounds", statistics.median(t for _, t, _ in res["ttft"]), "s")
        base = base or p50
    report.meta = {"conversations": args.conversations, "rounds": args.rounds, "workdir": str(work),
                   "lmcache": "not run: LMCacheConnectorV1 has no CPU connector (see shared notes)"}
    print(report.table())
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--engine":
        result = run_engine(json.loads(sys.argv[2]))
        print("\nRESULT " + json.dumps(result), flush=True)
    else:
        parser = argparse.ArgumentParser(prog="python -m tierstore_vllm.bench", description=__doc__.splitlines()[0])
        add_arguments(parser)
        sys.exit(run(parser.parse_args()))
