"""Build the engine tests' small random Llama (2 layers, 2 KV heads of 32) and tokenizer, offline."""

import sys

from tierstore_vllm.bench import build_llama

if __name__ == "__main__":
    print(build_llama(sys.argv[1]))
