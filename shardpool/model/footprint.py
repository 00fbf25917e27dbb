"""How much of the base model each stage holds: its parameter count and its size as NF4.

Shown in the placement table before a run starts. The decoder layers' Linear weights count as NF4
(4-bit codes, an 8-bit absmax per 64 weights, an fp32 scale per 256 absmax); everything else a
stage holds (embeddings, norms, lm_head) stays fp32.
"""

from __future__ import annotations

from shardpool.contract.job import StagePlacement
from shardpool.model.shape import ALL_DECODER_LINEAR_NAMES, ModelInfo
from shardpool.model.stage import StageSpec, owned_tensor_names
from shardpool.model.weights import WeightReader

__all__ = ["stage_footprints"]

_NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit codes + 8-bit absmax + fp32 per 256 absmax


def stage_footprints(model: ModelInfo, placements: list[StagePlacement]) -> list[tuple[int, float]]:
    """(parameters, MiB as NF4) of each stage of ``placements``, read from the safetensors headers."""
    footprints = []
    with WeightReader(model.path) as reader:
        for index, placement in enumerate(placements):
            spec = StageSpec(index, len(placements), placement.start, placement.stop, placement.device)
            footprints.append(_stage_footprint(reader, spec, model.tie_word_embeddings))
    return footprints


def _stage_footprint(reader: WeightReader, spec: StageSpec, tied: bool) -> tuple[int, float]:
    names = owned_tensor_names(spec, reader.names(), tie_word_embeddings=tied)
    params, nf4_bytes = 0, 0.0
    for name in names:
        count = 1
        for dim in reader.shape(name):
            count *= dim
        params += count
        quantized = name.startswith("model.layers.") and any(
            f".{linear}." in name for linear in ALL_DECODER_LINEAR_NAMES
        )
        nf4_bytes += count * (_NF4_BYTES_PER_PARAM if quantized else 4)
    return params, nf4_bytes / 2**20
