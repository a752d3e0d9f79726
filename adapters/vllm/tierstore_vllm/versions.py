"""Which vLLM releases the secondary tier and the CPU tiering spec are written against.

vLLM's secondary-tier API has changed between minors (0.25 → 0.26 reworked the spec; before 0.32 a tier
reported ``JobMetadata`` through ``get_finished``, since then ``TransferJob`` / ``get_finished_jobs``). An
engine on another release fails at start-up with this module's message instead of misbehaving later.
"""

from __future__ import annotations

from tierstore.errors import ConfigError

#: vLLM minors whose ``vllm.v1.kv_offload.tiering`` API the tier implements (checked by tests/engines)
SUPPORTED_MINORS = ("0.32", "0.33")

#: names the tier relies on in ``vllm.v1.kv_offload.tiering.base``
REQUIRED_NAMES = ("SecondaryTierManager", "TransferJob", "JobResult")


def check_vllm(version: str | None = None) -> str:
    """Return the running vLLM's version; raise :class:`tierstore.ConfigError` (a ``ValueError``) on a release
    whose tiering API this adapter does not implement."""
    if version is None:
        import vllm

        version = str(vllm.__version__)
    minor = ".".join(version.split("+")[0].split(".")[:2])
    if minor not in SUPPORTED_MINORS:
        raise ConfigError(f"tierstore_vllm's secondary tier supports vLLM {', '.join(SUPPORTED_MINORS)} (the "
                          f"TieringOffloadingSpec API with TransferJob/get_finished_jobs); this is vLLM {version}. "
                          "Use a supported vLLM, or TierstoreConnector (--kv-transfer-config) instead.")
    from vllm.v1.kv_offload.tiering import base

    missing = [name for name in REQUIRED_NAMES if not hasattr(base, name)]
    if missing:
        raise ConfigError(f"vLLM {version} lacks {missing} in vllm.v1.kv_offload.tiering.base: its secondary-tier "
                          "API is not the one tierstore_vllm implements")
    return version
