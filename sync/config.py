"""The weight sync's settings: transport, bucket size, shared memory, fingerprints and the probe.

Owned here, beside the sync code; `cluster/config.py` composes them into the run config. Imports only pydantic.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class SyncConfig(_Section):
    transport: Literal["object_store", "collective"] = "object_store"
    """How weights reach the engines: `object_store` puts them once (numpy, zero-copy) for every worker to read, or
    into a shared-memory buffer for workers on the learner's node (`shared_memory`); `collective` broadcasts them over
    a torch.distributed group of the learner's rank 0 and every engine (NCCL on GPUs, gloo on CPU)."""
    bucket_mb: float = Field(256.0, gt=0, le=65536)
    """Size of each weight bucket (one object-store object, or one broadcast of the collective transport), in MB."""
    shared_memory: bool = True
    """`object_store` only: workers on the learner's node read its weights from one shared-memory buffer that the
    learner rewrites in place at every sync (no new object-store object per sync, ~1 copy of the model's bytes);
    workers on other nodes get them through the object store either way. The buffer costs one host copy of the
    model in the learner's memory. Off: every worker reads through the object store (e.g. when workers cannot open
    the learner's `/proc/<pid>/fd`, as in another PID namespace)."""
    fingerprint: bool = True
    """After every load, each worker reports a fingerprint of every tensor it handed its engine (exact integer sums
    over the bits: sync/fingerprint.py) and the run stops if one differs from the learner's or is missing: exact in
    every dtype. Costs one pass over the weights per worker and load (docs/benchmarks.md, weight sync)."""
    probe: bool = True
    """After every load, compare each engine's logprobs on a fixed probe sequence with the learner's (with
    `object_store`, in the same request as the load: the start of the worker's next generate request). Off, a worker
    makes one call per step instead of a load, a probe and its request under `collective`; rollouts' weights versions
    are checked either way."""
    probe_tolerance: float | None = Field(None, gt=0)
    """Largest allowed probe gap: the root mean square over the probe's tokens of |engine - learner| logprob. Empty:
    derived from the noise floor the first probe measures before any update (engines and learner on the same weights),
    the largest gap of 8 seeded draws: 3x it, at least 1e-4 in float32 and 2^-3 in bfloat16 (one ulp of a logit of 16
    to 32: training that sharpens the logits raises bfloat16's noise; below it, one step's change at small learning
    rates is left to the probe's repeat rule and the fingerprints: docs/operations.md). A floor above 0.25 stops the
    run: that is not numerics."""
    probe_tokens: int = Field(8, ge=1, le=1024)
    """Tokens the probe samples from its fixed prompt."""
    probe_prompt: str = Field("1+1=2 2+2=4 3+3=6 4+4=8 5+5=10 6+6=12 7+7=14 ", min_length=1)
    """Fixed probe prompt; longer than one KV block (32 tokens) so a missed prefix-cache reset shows up."""
