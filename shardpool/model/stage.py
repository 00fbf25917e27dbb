"""One pipeline stage: a contiguous run of decoder layers, NF4-quantized on its device, with LoRA.

A stage is the transformers model with the layers it does not own removed. It is built on the
meta device (no memory), pruned to what it owns, and only then are the owned tensors read from the
safetensors files and placed on the device. Stage 0 also owns the embeddings; the last stage owns
the final norm and ``lm_head``. Layers keep their global indices (a ``ModuleDict`` keyed ``"5"``
names its modules ``model.layers.5...`` just like the full model's ``ModuleList``), so peft's
adapter keys are the whole model's keys whatever the split, and each layer gets the attention
mask and rotary embedding of its own type (Gemma's sliding-window and full layers).

A stage runs the model's own modules: its (Gemma: scaled) embedding, decoder layers, final norm
and ``lm_head``, and the model's final logit soft-capping. With tied embeddings the first and the
last stage each hold the embedding matrix, frozen; LoRA never targets it (only decoder Linears
are targets), so both copies stay the checkpoint's.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PretrainedConfig
from transformers.cache_utils import Cache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from shardpool.errors import ShardpoolError
from shardpool.model.lora import LoraSettings, init_lora_weights, peft_config, read_adapter_tensors
from shardpool.model.nf4 import DTYPES, NF4Backend, quantize_linear
from shardpool.model.shape import EMBED_NAME, LM_HEAD_NAME, decoder_linear_names, layer_prefix, mask_kind
from shardpool.model.weights import WeightReader

__all__ = [
    "StageSpec",
    "BaseSettings",
    "PipelineStage",
    "build_stage",
    "owned_tensor_names",
    "reusable_modules",
]

_MASK_BUILDERS = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
}


@dataclass(frozen=True)
class StageSpec:
    """Which layers one stage owns, out of how many stages, and on which torch device."""

    index: int
    num_stages: int
    start: int
    stop: int
    device: str

    @property
    def is_first(self) -> bool:
        """Stage 0 owns the token embeddings."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """The last stage owns the final norm and lm_head, and computes the loss."""
        return self.index == self.num_stages - 1

    @property
    def layer_indices(self) -> range:
        """Global indices of the decoder layers this stage owns."""
        return range(self.start, self.stop)


@dataclass(frozen=True)
class BaseSettings:
    """How the frozen base is loaded: quantized or not, and in which dtype it computes."""

    quantize: bool = True
    quant_type: str = "nf4"
    double_quant: bool = True
    compute_dtype: str = "float32"
    gradient_checkpointing: bool = False
    attn_implementation: str = "sdpa"
    #: How the stage computes with its NF4 weights: bitsandbytes' kernels or plain PyTorch (model/nf4.py).
    nf4_backend: NF4Backend = "bitsandbytes"


def owned_tensor_names(spec: StageSpec, available: list[str], *, tie_word_embeddings: bool) -> list[str]:
    """The checkpoint tensors a stage reads: its layers, plus embeddings or norm/lm_head at the ends."""
    prefixes = tuple(layer_prefix(index) for index in spec.layer_indices)
    owned = [name for name in available if name.startswith(prefixes)]
    if spec.is_first:
        owned.append(EMBED_NAME)
    if spec.is_last:
        owned.append("model.norm.weight")
        owned.append(EMBED_NAME if tie_word_embeddings and LM_HEAD_NAME not in available else LM_HEAD_NAME)
    return sorted(set(owned), key=owned.index)


class PipelineStage(nn.Module):
    """The forward of one stage, and access to its LoRA tensors under their global keys."""

    def __init__(
        self,
        peft_model: nn.Module,
        spec: StageSpec,
        hf_config: PretrainedConfig,
        gradient_checkpointing: bool,
    ):
        super().__init__()
        self.peft_model = peft_model
        self.spec = spec
        self.hf_config = hf_config
        self.gradient_checkpointing = gradient_checkpointing
        causal_lm = peft_model.get_base_model()
        self._inner = causal_lm.model
        self._lm_head = causal_lm.lm_head if spec.is_last else None
        self._mask_kinds = {index: mask_kind(hf_config, index) for index in spec.layer_indices}
        # Gemma 3 keeps one rotary base per attention type (local and global layers).
        self._rotary_per_kind = "layer_type" in inspect.signature(self._inner.rotary_emb.forward).parameters
        self._softcap = getattr(hf_config, "final_logit_softcapping", None)
        self._first_of_kind: dict[str, int] = {}
        for index, kind in self._mask_kinds.items():
            self._first_of_kind.setdefault(kind, index)
        # transformers 5.x renames the cache argument (past_key_values -> cache) release by release.
        self._mask_cache_kwarg = _cache_kwarg(create_causal_mask)
        layers = list(self._inner.layers.values())
        self._layer_cache_kwarg = _cache_kwarg(type(layers[0]).forward) if layers else "cache"

    def forward(
        self,
        inputs: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (stage 0) or hidden states in; hidden states or logits (last stage) out.

        ``keep`` (last stage): a boolean mask of the positions whose logits are wanted; the logits
        then come out as ``[kept, vocab]``, in row order. The final norm and ``lm_head`` act on
        each position alone, so they run on those positions only.
        """
        hidden = self._inner.embed_tokens(inputs) if self.spec.is_first else inputs
        kinds = set(self._mask_kinds.values())
        if self._rotary_per_kind:
            rotary = {kind: self._inner.rotary_emb(hidden, position_ids, kind) for kind in kinds}
        else:
            shared = self._inner.rotary_emb(hidden, position_ids=position_ids)
            rotary = dict.fromkeys(kinds, shared)
        masks = {
            kind: _MASK_BUILDERS[kind](
                config=self.hf_config,
                inputs_embeds=hidden,
                attention_mask=attention_mask,
                past_key_values=None,
                position_ids=position_ids,
            )
            for kind in kinds
        }
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for index in self.spec.layer_indices:
            layer = self._inner.layers[str(index)]
            layer_kwargs = {
                "attention_mask": masks[self._mask_kinds[index]],
                "position_ids": position_ids,
                "position_embeddings": rotary[self._mask_kinds[index]],
                "use_cache": False,
            }
            if recompute:
                hidden = checkpoint(layer, hidden, use_reentrant=False, **layer_kwargs)
            else:
                hidden = layer(hidden, **layer_kwargs)
        if not self.spec.is_last:
            return hidden
        if keep is not None:
            hidden = hidden[keep]
        logits = self._lm_head(self._inner.norm(hidden))
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def new_cache(self) -> Cache:
        """An empty KV cache for one sequence on this stage: transformers' own, sized lazily, so it
        holds keys and values of the owned layers only (sliding-window layers keep their window)."""
        return DynamicCache(config=self.hf_config)

    @torch.no_grad()
    def forward_cached(
        self, inputs: torch.Tensor, *, cache: Cache, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """Generation's forward: the new tokens (ids at stage 0, else hidden states) attend to what
        ``cache`` holds of the sequence and are added to it; the last stage returns the logits of
        the last position only (as ``generate`` computes them), every other stage hidden states.

        The layers are the model's own, called as its ``forward`` calls them with a cache, and the
        adapter stays unmerged (peft's arithmetic), so greedy tokens equal peft's ``generate``.
        """
        hidden = self._inner.embed_tokens(inputs) if self.spec.is_first else inputs
        kinds = set(self._mask_kinds.values())
        rotary = self._rotary(hidden, position_ids, kinds)
        masks = {
            kind: _MASK_BUILDERS[kind](
                config=self.hf_config,
                inputs_embeds=hidden,
                attention_mask=None,
                position_ids=position_ids,
                layer_idx=self._first_of_kind[kind],
                **{self._mask_cache_kwarg: cache},
            )
            for kind in kinds
        }
        for index in self.spec.layer_indices:
            kind = self._mask_kinds[index]
            hidden = self._inner.layers[str(index)](
                hidden,
                attention_mask=masks[kind],
                position_ids=position_ids,
                position_embeddings=rotary[kind],
                use_cache=True,
                **{self._layer_cache_kwarg: cache},
            )
        if not self.spec.is_last:
            return hidden
        return self._logits(hidden[:, -1:, :])

    def _rotary(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, kinds: set[str]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if self._rotary_per_kind:
            return {kind: self._inner.rotary_emb(hidden, position_ids, kind) for kind in kinds}
        shared = self._inner.rotary_emb(hidden, position_ids=position_ids)
        return dict.fromkeys(kinds, shared)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._lm_head(self._inner.norm(hidden))
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def lora_parameters(self) -> list[nn.Parameter]:
        """The trainable LoRA parameters, in a fixed order."""
        return [param for _, param in self.named_lora_parameters()]

    def named_lora_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(global adapter key, parameter) for every trainable LoRA tensor, sorted by key."""
        named = [
            (_adapter_key(name), param)
            for name, param in self.peft_model.named_parameters()
            if param.requires_grad
        ]
        return sorted(named, key=lambda item: item[0])

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """The stage's LoRA tensors keyed as peft saves them for the whole model."""
        return dict(get_peft_model_state_dict(self.peft_model, save_embedding_layers=False))

    def load_lora_state_dict(self, tensors: dict[str, torch.Tensor], *, source: str) -> None:
        """Load this stage's part of a whole-model adapter; every owned key must be present."""
        wanted = set(self.lora_state_dict())
        missing = sorted(wanted - tensors.keys())
        if missing:
            raise ShardpoolError(
                f"{source} lacks {len(missing)} LoRA tensors, e.g. {missing[0]}; it does not fit this model"
            )
        subset = {name: tensors[name] for name in wanted}
        for name, tensor in subset.items():
            expected = self.lora_state_dict()[name].shape
            if tensor.shape != expected:
                raise ShardpoolError(
                    f"{source}: {name} has shape {tuple(tensor.shape)}, expected {tuple(expected)}"
                )
        result = set_peft_model_state_dict(self.peft_model, subset)
        if result.unexpected_keys:
            raise ShardpoolError(f"{source}: unexpected LoRA keys such as {result.unexpected_keys[0]}")


def reusable_modules(stage: PipelineStage) -> dict[str, nn.Module]:
    """The stage's base modules without their LoRA, by path in the causal LM, for :func:`build_stage`'s ``reuse``.

    Removes the LoRA from ``stage`` (peft's ``unload``), which is then no longer trainable: this
    is for a stage about to be rebuilt with other layers (an in-place re-shard), so that the
    layers it keeps are neither read nor quantized again.
    """
    causal_lm = stage.peft_model.unload()
    inner = causal_lm.model
    modules: dict[str, nn.Module] = {f"model.layers.{name}": layer for name, layer in inner.layers.items()}
    for path, module in (
        ("model.embed_tokens", inner.embed_tokens),
        ("model.norm", inner.norm),
        ("lm_head", causal_lm.lm_head),
    ):
        if module is not None:
            modules[path] = module
    return modules


def _cache_kwarg(function: object) -> str:
    """The name under which ``function`` (a decoder layer's forward, the mask builders) takes the KV cache."""
    wrapped = inspect.unwrap(function)  # type: ignore[arg-type]
    return "cache" if "cache" in inspect.signature(wrapped).parameters else "past_key_values"


def _adapter_key(parameter_name: str) -> str:
    return parameter_name.replace(".default.", ".")


def build_stage(
    model_dir: str | Path,
    spec: StageSpec,
    base: BaseSettings,
    lora: LoraSettings,
    *,
    seed: int,
    reader: WeightReader | None = None,
    reuse: dict[str, nn.Module] | None = None,
) -> PipelineStage:
    """Build one stage on its device from only the tensors it owns, then add LoRA to it.

    The LoRA starts from ``lora.init_from`` when given, else from a per-module seeded draw, so
    every split of the same config starts from the same adapter. ``reuse`` holds base modules
    this process already built on this device (:func:`reusable_modules`), by path; those the new
    stage owns are taken as they are instead of being read and quantized again.
    """
    device = torch.device(spec.device)
    compute_dtype = DTYPES[base.compute_dtype]
    hf_config = AutoConfig.from_pretrained(str(model_dir))
    hf_config.use_cache = False
    if lora.all_linear:
        lora = replace(lora, target_modules=decoder_linear_names(hf_config.model_type))
    owns_reader = reader is None
    reader = reader or WeightReader(model_dir)
    try:
        hf_config._attn_implementation = _attention_for(hf_config, base.attn_implementation)
        model = _pruned_skeleton(hf_config, spec)
        _take_reused(model, reuse or {})
        _materialize(
            model,
            reader,
            spec,
            base,
            device=device,
            compute_dtype=compute_dtype,
            tied=hf_config.tie_word_embeddings,
        )
    finally:
        if owns_reader:
            reader.close()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hf_config).to(device)
    _materialize_buffers(model, device)
    peft_model = get_peft_model(model, peft_config(lora))
    # model.config, not hf_config: building the model resolved its attention implementation,
    # which decides how the attention masks are made.
    stage = PipelineStage(peft_model, spec, model.config, base.gradient_checkpointing)
    if not stage.lora_parameters():
        raise ShardpoolError(
            f"lora_target_modules {list(lora.target_modules)} match nothing in stage {spec.index}; fix the targets"
        )
    if lora.init_from:
        stage.load_lora_state_dict(
            read_adapter_tensors(lora.init_from), source=f"lora_model_dir {lora.init_from}"
        )
    else:
        lora_a = {name: param for name, param in stage.named_lora_parameters() if ".lora_A." in name}
        init_lora_weights(lora_a, seed=seed)
    stage.train()
    return stage


def _model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    return AutoModelForCausalLM._model_mapping[type(hf_config)]


def _attention_for(hf_config: PretrainedConfig, requested: str) -> str:
    """The attention implementation a stage builds: ``requested``, or eager where the model has no SDPA
    (Gemma 2: SDPA cannot soft-cap), as transformers itself falls back when it loads the model."""
    if requested == "sdpa" and not getattr(_model_class(hf_config), "_supports_sdpa", True):
        return "eager"
    return requested


def _pruned_skeleton(hf_config: PretrainedConfig, spec: StageSpec) -> nn.Module:
    model_class = _model_class(hf_config)
    # A stage never holds both ends of tied embeddings together (unless S = 1), so it is built
    # untied and its lm_head is loaded from the embedding tensor instead, or at S = 1 given the
    # embedding's own matrix (see _materialize).
    skeleton_config = copy.deepcopy(hf_config)
    skeleton_config.tie_word_embeddings = False
    with torch.device("meta"):
        model = model_class(skeleton_config)
    inner = model.model
    if spec.stop > len(inner.layers):
        raise ShardpoolError(
            f"stage {spec.index} asks for layers up to {spec.stop} but the model has {len(inner.layers)}"
        )
    inner.layers = nn.ModuleDict({str(index): inner.layers[index] for index in spec.layer_indices})
    if not spec.is_first:
        inner.embed_tokens = None
    if not spec.is_last:
        inner.norm = None
        model.lm_head = None
    return model


def _take_reused(model: nn.Module, reuse: dict[str, nn.Module]) -> None:
    """Put the reused modules the skeleton still holds (on the meta device) in their place."""
    for path, module in reuse.items():
        owner_path, _, leaf = path.rpartition(".")
        try:
            owner = model.get_submodule(owner_path) if owner_path else model
        except AttributeError:
            continue
        if getattr(owner, leaf, None) is not None:  # the new stage owns it
            setattr(owner, leaf, module)


def _materialize(
    model: nn.Module,
    reader: WeightReader,
    spec: StageSpec,
    base: BaseSettings,
    *,
    device: torch.device,
    compute_dtype: torch.dtype,
    tied: bool,
) -> None:
    if base.quantize:
        for layer_index in spec.layer_indices:
            layer = model.model.layers[str(layer_index)]
            for name, module in list(layer.named_modules()):
                if isinstance(module, nn.Linear) and module.weight.device.type == "meta":
                    prefix = f"{layer_prefix(layer_index)}{name}."
                    bias = reader.read(prefix + "bias").to(compute_dtype) if module.bias is not None else None
                    quantized = quantize_linear(
                        reader.read(prefix + "weight").to(compute_dtype),
                        bias,
                        device=device,
                        compute_dtype=compute_dtype,
                        quant_type=base.quant_type,
                        double_quant=base.double_quant,
                        backend=base.nf4_backend,
                    )
                    layer.set_submodule(name, quantized)
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if param.device.type != "meta":
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if name == LM_HEAD_NAME and tied and not reader.has(LM_HEAD_NAME):
            embedding = model.model.embed_tokens
            if embedding is not None and embedding.weight.device.type != "meta":
                owner._parameters[leaf] = embedding.weight  # one stage holds both ends: one matrix
                continue
            name = EMBED_NAME
        tensor = reader.read(name).to(device=device, dtype=compute_dtype)
        owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


def _materialize_buffers(model: nn.Module, device: torch.device) -> None:
    """Give the buffers no checkpoint holds (Gemma's embedding scale) their values, on ``device``."""
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is None or buffer.device.type != "meta":
                continue
            if name == "embed_scale" and hasattr(module, "scalar_embed_scale"):
                module._buffers[name] = torch.tensor(module.scalar_embed_scale, device=device)
            else:
                raise ShardpoolError(
                    f"{type(module).__name__}.{name} is not in the checkpoint and shardpool cannot compute it; "
                    "this model's architecture is not supported"
                )
