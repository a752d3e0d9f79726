"""``TierstoreModelLoader``: SGLang's default loader with the weights read by :mod:`tierstore.weights`.

SGLang has no registry of load formats (``--load-format`` is a closed enum), but its
``get_model_loader`` takes a loader *class* as ``load_format``, so the Python API selects this one::

    sgl.Engine(model_path="/models/llama", load_format=TierstoreModelLoader,
               model_loader_extra_config={"uri": "s3://bucket/llama", "store": {...}})

Options (``model_loader_extra_config``):

* ``uri``: where the safetensors live: a local path or any fsspec URL; default the model directory
  (SGLang still reads ``config.json`` and the tokenizer from ``model_path``).
* ``storage_options``: fsspec options for ``uri`` (e.g. ``{"endpoint_url": ...}``).
* ``store``: a tierstore config (dict or path); fetched byte ranges are cached there, so the next load of
  an S3 checkpoint reads local disk. Each TP rank caches in its own ``tp<rank>`` disk subdirectory.
* SGLang's own ``enable_multithread_load`` / ``num_threads`` keep their meaning.

Everything else (stacked/sharded parameters, TP slicing, post-processing) is SGLang's
``DefaultModelLoader`` and the model's own ``load_weights``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from typing import TYPE_CHECKING

import torch
from sglang.srt.model_loader.loader import DefaultModelLoader

from tierstore.engines import iter_weights, split_loader_options

if TYPE_CHECKING:
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig


class TierstoreModelLoader(DefaultModelLoader):
    """SGLang's default loader reading safetensors through ``tierstore.weights.iter_tensors``."""

    def __init__(self, load_config: LoadConfig):
        self.tierstore_options, extra = split_loader_options(load_config.model_loader_extra_config)
        super().__init__(dataclasses.replace(load_config, model_loader_extra_config=extra))
        self.load_config = load_config

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to prepare: reads are streamed (and cached) while the weights load."""

    def _get_all_weights(self, model_config: ModelConfig,
                         model: torch.nn.Module) -> Generator[tuple[str, torch.Tensor], None, None]:
        yield from iter_weights(self.tierstore_options.get("uri") or model_config.model_path, self.tierstore_options,
                                f"tp{self.load_config.tp_rank or 0}")
