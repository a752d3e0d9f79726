"""TierstoreModelLoader through SGLang 0.5.23's own loader dispatch (``get_model_loader`` with a loader
class as ``load_format``) and weight path (``DefaultModelLoader.load_weights_and_postprocess``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.model_loader.loader import get_model_loader
from tierstore_sglang import TierstoreModelLoader

from tierstore.errors import ConfigError
from tierstore.weights.synth import random_tensor, write_checkpoint


class TinyModel(torch.nn.Module):
    """Parameters named like a checkpoint; ``load_weights`` as SGLang models have it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16, dtype=torch.bfloat16)
        self.proj = torch.nn.Linear(16, 16, dtype=torch.float32)

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded


def test_loader_class_as_load_format_fills_the_model_through_tierstore(tmp_path, s3_server):
    g = torch.Generator().manual_seed(1)
    want = {"embed.weight": random_tensor((64, 16), torch.bfloat16, g),
            "proj.weight": random_tensor((16, 16), torch.float32, g),
            "proj.bias": random_tensor((16,), torch.float32, g)}
    write_checkpoint(str(tmp_path / "ck"), want, shard_size=4000)
    bucket = s3_server.new_bucket()
    s3_server.filesystem().put(str(tmp_path / "ck") + "/", f"{bucket}/ck/", recursive=True)
    options = {k: v for k, v in s3_server.storage_options.items() if k != "skip_instance_cache"}
    store = {"tiers": [{"kind": "disk", "path": str(tmp_path / "cache"), "capacity": "64MiB"}]}
    config = LoadConfig(load_format=TierstoreModelLoader, tp_rank=0, model_loader_extra_config={
        "uri": f"s3://{bucket}/ck", "storage_options": options, "store": store, "enable_multithread_load": False})
    loader = get_model_loader(config)
    assert isinstance(loader, TierstoreModelLoader)
    for _ in range(2):  # the second load reads the cached ranges
        model = TinyModel()
        weights = loader._get_all_weights(SimpleNamespace(model_path=str(tmp_path / "unused")), model)
        loader.load_weights_and_postprocess(model, weights, torch.device("cpu"))
        for name, param in model.named_parameters():
            assert torch.equal(param.data.view(torch.uint8), want[name].view(torch.uint8)), name
    assert list((tmp_path / "cache" / "tp0").rglob("*.tso")), "S3 ranges were cached on local disk"
    with pytest.raises(ConfigError, match="uri"):
        TierstoreModelLoader(LoadConfig(load_format=TierstoreModelLoader, model_loader_extra_config={"uri": 3}))
