"""What the driver tells each inference stage process: the model, the adapter, every stage's place,
the rendezvous. Written by the driver into a private file; a closed schema, like a training job."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field, ValidationError

from mesh.files import write_json
from shardpool.contract.fields import Closed, describe_validation_error
from shardpool.contract.job import StagePlacement
from shardpool.errors import ShardpoolError

__all__ = ["InferenceSpec"]


class InferenceSpec(Closed):
    """One inference pipeline: S stages (ranks 0..S-1) and the driver (rank S)."""

    model_dir: str = Field(min_length=1, max_length=4096)
    adapter_dir: str | None = Field(default=None, min_length=1, max_length=4096)
    lora_r: int = Field(default=8, ge=1, le=65536)
    lora_alpha: float = Field(default=16.0, gt=0, allow_inf_nan=False)
    lora_targets: tuple[str, ...] = ()
    stages: tuple[StagePlacement, ...] = Field(min_length=1, max_length=256)
    master_addr: str = Field(min_length=1, max_length=255)
    master_port: int = Field(ge=1, le=65535)
    threads_per_process: int = Field(ge=1, le=4096)
    timeout_s: float = Field(default=300.0, gt=0, le=7 * 86400, allow_inf_nan=False)

    @property
    def num_stages(self) -> int:
        """How many stage processes the ring has."""
        return len(self.stages)

    @property
    def driver_rank(self) -> int:
        """The driver's rank: the one after the last stage."""
        return len(self.stages)

    def write(self, path: Path) -> None:
        """Write the spec atomically, readable by its owner only."""
        write_json(path, self.model_dump(mode="json"), mode=0o600)

    @classmethod
    def read(cls, path: Path) -> InferenceSpec:
        """The spec at ``path``; one line when it is missing or malformed."""
        try:
            return cls.model_validate_json(Path(path).read_bytes(), strict=False)
        except OSError as error:
            raise ShardpoolError(f"cannot read the inference spec {path}: {error.strerror}") from None
        except ValidationError as error:
            raise ShardpoolError(describe_validation_error(error, str(path))) from None
        except json.JSONDecodeError as error:
            raise ShardpoolError(f"{path} is not JSON: {error}") from None
