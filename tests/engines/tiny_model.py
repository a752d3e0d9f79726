"""Build a small random Llama and a byte-level BPE tokenizer offline (no downloads)."""

from __future__ import annotations

import sys
from pathlib import Path

CORPUS = ("The quick brown fox jumps over the lazy dog. " * 4 + "tierstore keeps KV caches in tiers: device, host, "
          "disk and remote. vLLM asks the connector how many prompt tokens it can load. " * 4)


def build(path: str | Path, seed: int = 0) -> Path:
    """Write ``config.json``, ``model.safetensors`` (tied embeddings) and a tokenizer into ``path``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         bos_token_id=0, eos_token_id=1, tie_word_embeddings=True, initializer_range=0.5,
                         torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return path


if __name__ == "__main__":
    print(build(sys.argv[1]))
