"""``--load-format tierstore``: vLLM's default loader with the weights read by :mod:`tierstore.weights`.

Options (``--model-loader-extra-config``):

* ``uri``: where the safetensors live: a local path or any fsspec URL (``s3://bucket/llama``); default
  the model directory. vLLM still reads ``config.json`` and the tokenizer from ``--model``.
* ``storage_options``: fsspec options for ``uri`` (e.g. ``{"endpoint_url": ...}``).
* ``store``: a tierstore config (dict or path); fetched byte ranges are cached there, so the next load
  of an S3 checkpoint reads local disk. Each tensor/pipeline-parallel rank caches in its own disk subdir.
* vLLM's own ``enable_multithread_load``/``num_threads``/``enable_weights_track`` keep their meaning.

Everything else (stacked/sharded parameters, TP slicing, tied embeddings, the strict check that every
parameter was loaded) is vLLM's ``DefaultModelLoader`` and the model's own ``load_weights``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from typing import TYPE_CHECKING

import torch
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from tierstore.engines import iter_weights, split_loader_options

if TYPE_CHECKING:
    from vllm.config import ModelConfig
    from vllm.config.load import LoadConfig


@register_model_loader("tierstore")
class TierstoreModelLoader(DefaultModelLoader):
    """vLLM's default loader reading safetensors through ``tierstore.weights.iter_tensors``."""

    def __init__(self, load_config: LoadConfig):
        self.tierstore_options, extra = split_loader_options(load_config.model_loader_extra_config)
        super().__init__(dataclasses.replace(load_config, model_loader_extra_config=extra))
        self.load_config = load_config

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to prepare: reads are streamed (and cached) during :meth:`load_weights`."""

    def get_all_weights(self, model_config: ModelConfig,
                        model: torch.nn.Module) -> Generator[tuple[str, torch.Tensor], None, None]:
        rank_dir = None
        if self.tierstore_options.get("store") is not None:  # one disk directory per rank when several
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            pp = get_pp_group()
            if _tp_size() * pp.world_size > 1:
                rank_dir = f"tp{get_tensor_model_parallel_rank()}-pp{pp.rank_in_group}"
        yield from iter_weights(self.tierstore_options.get("uri") or model_config.model, self.tierstore_options,
                                rank_dir)


def _tp_size() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size

    return int(get_tensor_model_parallel_world_size())
