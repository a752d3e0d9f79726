"""What the scheduler tells the workers each step (vLLM ships it to them inside the connector
metadata): which prefixes to load into which blocks, and which to save from which blocks."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoadSpec:
    """Load the KV of ``token_ids`` (a chunk-aligned prompt prefix) and write tokens ``[start, end)``
    into the request's blocks; vLLM already holds ``[0, start)`` in its own prefix cache."""

    req_id: str
    token_ids: list[int]
    start: int
    block_ids: list[int]
    tenant: str | None = None

    @property
    def end(self) -> int:
        return len(self.token_ids)


@dataclass
class SaveSpec:
    """Save the KV of ``token_ids`` (full chunks of the prompt and of the tokens decoded after it), held in
    ``block_ids`` in order; tokens ``[0, start)`` were saved by an earlier step (only the rest is copied)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    tenant: str | None = None
    start: int = 0


@dataclass
class StepPlan:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
