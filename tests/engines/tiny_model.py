"""Build the engine tests' small random models, offline: ``tiny_model.py PATH`` a Llama (2 layers, 2 KV heads of
32), ``tiny_model.py PATH gemma3`` a Gemma-3 with sliding-window and full-attention layers (a hybrid model: vLLM
gives it two KV cache groups)."""

import sys

from tierstore_vllm.bench import build_llama


def build_gemma3(path: str) -> str:
    """Four layers alternating sliding-window (128 tokens) and full attention, the Llama's tokenizer. Gemma
    scales embeddings by sqrt(hidden); they are shrunk so that attention, hence the KV, decides the output."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    build_llama(path)  # for its tokenizer
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=128,
                              layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=8192,
                              bos_token_id=0, eos_token_id=1, pad_token_id=1, initializer_range=0.3,
                              torch_dtype="bfloat16")
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(0.05)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)  # replaces the Llama's files
    return path


if __name__ == "__main__":
    print(build_gemma3(sys.argv[1]) if sys.argv[2:] == ["gemma3"] else build_llama(sys.argv[1]))
