"""How shardpool treats each axolotl key that is not in its schema, so pasted configs run as they are.

Every key of axolotl's config schema that :class:`~shardpool.config.schema.Config` lacks is here,
with one of two treatments:

* ``ignored``: the key never changes what a run computes (a hint such as ``model_type``, a cache
  path, a setting of a feature that is off); any value is accepted and dropped.
* ``when_off``: the key changes the run when it is on. Its "off" values are accepted and dropped:
  null, an empty string, list or mapping, ``false`` (where false means off) and the values listed
  in ``accepted`` (what shardpool already does, e.g. ``pad_to_sequence_len: true``). Any other
  value is refused in one line that says why and what to do.

docs/config.md has the same table for people; a test keeps the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["AxolotlKey", "AXOLOTL_KEYS", "is_off"]


def is_off(value: Any) -> bool:
    """True for the values axolotl reads as "not set": null, and an empty string, list or mapping."""
    return value is None or (isinstance(value, str | list | dict) and not value)


@dataclass(frozen=True)
class AxolotlKey:
    """One axolotl key shardpool does not implement as a field, and what it accepts for it."""

    name: str
    treatment: Literal["ignored", "when_off"]
    why: str
    accepted: tuple[Any, ...] = ()
    false_is_off: bool = True

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` leaves a shardpool run exactly as it would be without the key."""
        if self.treatment == "ignored" or is_off(value):
            return True
        if value is False and self.false_is_off:
            return True
        return any(type(value) is type(ok) and value == ok for ok in self.accepted)

    def refusal(self) -> str:
        """The one line that refuses a value this key does not accept."""
        return f"`{self.name}` is not supported by shardpool: {self.why}"

    def accepted_text(self) -> str:
        """The accepted values, for docs/config.md."""
        if self.treatment == "ignored":
            return "any value"
        shown = ["null", "empty"] + (["`false`"] if self.false_is_off else [])
        shown += [f"`{str(value).lower() if isinstance(value, bool) else value}`" for value in self.accepted]
        return ", ".join(shown)


def _keys(
    names: str, treatment: Literal["ignored", "when_off"], why: str, **options: Any
) -> list[AxolotlKey]:
    return [AxolotlKey(name, treatment, why, **options) for name in names.split()]


_NOT_BUILT = "not built in shardpool; remove it (or set it to null)"
_SHARDS_ITSELF = "shardpool splits the model into pipeline stages itself; remove it"
_LOGGING = (
    "only metrics.jsonl, TensorBoard (`use_tensorboard`) and W&B (`wandb_project`) are written; "
    "remove it (or leave it empty)"
)
_TOKENS = (
    "adding tokens to the vocabulary is not supported (a frozen NF4 base cannot train new embeddings); "
    "`special_tokens` may name tokens the tokenizer already has"
)

_GROUPS: list[list[AxolotlKey]] = [
    # ----- hints: they never change what is computed ---------------------------------------------
    _keys(
        "model_type type_of_model tokenizer_type is_falcon_derived_model is_llama_derived_model "
        "is_mistral_derived_model is_qwen_derived_model",
        "ignored",
        "the architecture and the tokenizer are read from base_model",
    ),
    _keys("strict", "ignored", "shardpool's validation is always strict"),
    _keys(
        "debug",
        "ignored",
        "axolotl's debug output of tokenized rows; it never changes what is trained "
        "(`shardpool validate` reads every row)",
    ),
    _keys(
        "dataset_prepared_path push_dataset_to_hub num_dataset_shards_to_save dataset_keep_in_memory "
        "dataset_processes dataset_num_proc is_preprocess preprocess_iterable skip_prepare_dataset",
        "ignored",
        "datasets are tokenized for each run; no prepared copy is read or written",
    ),
    _keys(
        "total_num_tokens total_supervised_tokens sample_packing_eff_est axolotl_config_path",
        "ignored",
        "statistics axolotl caches for itself; shardpool counts its own",
    ),
    _keys(
        "local_rank world_size ddp ddp_timeout ddp_bucket_cap_mb ddp_broadcast_buffers "
        "ddp_find_unused_parameters device device_map max_memory gpu_memory_limit low_cpu_mem_usage "
        "qlora_sharded_model_loading experimental_skip_move_to_device",
        "ignored",
        "shardpool starts its own processes and places the layers itself (`shardpool:` block)",
    ),
    _keys(
        "dataloader_pin_memory dataloader_num_workers dataloader_prefetch_factor remove_unused_columns "
        "gc_steps gc_collect_steps torch_empty_cache_steps hf_use_auth_token tokenizer_save_jinja_files",
        "ignored",
        "a loading or housekeeping setting that does not change what is trained",
    ),
    _keys(
        "include_tokens_per_second include_tkps", "ignored", "tokens per second are always in metrics.jsonl"
    ),
    _keys("eval_table_size eval_max_new_tokens", "ignored", "sample predictions are not logged; the loss is"),
    _keys(
        "gradient_checkpointing_kwargs",
        "ignored",
        "shardpool recomputes layers its own way; the gradients are the same",
    ),
    _keys(
        "eval_sample_packing",
        "ignored",
        "eval rows are packed exactly when training rows are; packed rows keep samples apart",
    ),
    _keys(
        "loss_watchdog_threshold loss_watchdog_patience",
        "ignored",
        "there is no loss watchdog: a diverging run is not stopped early (its loss is in metrics.jsonl)",
    ),
    _keys(
        "gradio_title gradio_share gradio_server_name gradio_server_port gradio_max_new_tokens "
        "gradio_temperature",
        "ignored",
        "settings of axolotl's inference UI, not of training",
    ),
    _keys(
        "generation_max_new_tokens generation_temperature generation_top_p generation_top_k "
        "generation_prompt_ratio generation_do_sample num_generation_samples",
        "ignored",
        "only read with `generate_samples`, which is refused",
    ),
    _keys(
        "qgalore_rank qgalore_update_proj_gap qgalore_scale qgalore_proj_type qgalore_proj_quant "
        "qgalore_proj_bits qgalore_proj_group_size qgalore_cos_threshold qgalore_gamma_proj "
        "qgalore_queue_size dion_lr dion_momentum dion_rank_fraction dion_rank_multiple_of "
        "adam_epsilon2 adam_beta3 lr_div_factor",
        "ignored",
        "only read by optimizers or schedulers shardpool refuses",
    ),
    _keys(
        "trl vllm ebft dpo_use_liger_kernel dpo_padding_free dpo_use_logits_to_keep dpo_generate_during_eval "
        "kto_desirable_weight kto_undesirable_weight max_prompt_len center_rewards_coefficient num_labels",
        "ignored",
        "only read by `rl` methods shardpool does not build (kto, grpo, ...) or by reward models, which are refused",
    ),
    _keys(
        "dpo_use_weighting dpo_loss_weights dpo_norm_loss rpo_alpha",
        "when_off",
        "not built for `rl: dpo` yet (the reference log-probabilities are computed in each step); remove it",
    ),
    _keys(
        "relora_prune_ratio relora_prune_method relora_cpu_offload jagged_restart_warmup_steps "
        "jagged_restart_anneal_steps lisa_layers_attribute loraplus_lr_embedding eaft_alpha eaft_k "
        "tiled_mlp_num_shards tiled_mlp_use_original_mlp chunked_cross_entropy_num_chunks "
        "scaling_softmax_factor scaling_softmax_bias pose_split_on_token_ids pose_max_context_len "
        "pose_num_chunks torch_compile_backend torch_compile_mode torch_compile_options "
        "flex_attn_compile_kwargs profiler_steps_start streaming_multipack_buffer_size "
        "pretrain_multipack_buffer_size pretrain_multipack_attn otel_metrics_host otel_metrics_port "
        "ray_run_name ray_num_workers resources_per_worker fsdp_version fsdp_final_state_dict_type "
        "heads_k_stride ring_attn_func metric_for_best_model greater_is_better mean_resizing_embeddings "
        "merge_method image_resize_algorithm",
        "ignored",
        "only read together with another key that shardpool refuses when it is on",
    ),
    _keys(
        "liger_rms_norm liger_glu_activation liger_layer_norm liger_rope liger_fused_linear_cross_entropy "
        "liger_rms_norm_gated cut_cross_entropy use_scattermoe use_sonicmoe use_dsv4_kernels "
        "dsv4_fp4_grouped_mode use_glm_dsa_kernels nvfp4_merge_aware expert_parallel_size "
        "expert_parallel_num_nvl_bytes expert_parallel_token_capacity use_swanlab swanlab_project "
        "swanlab_experiment_name swanlab_description swanlab_mode swanlab_workspace swanlab_log_model "
        "swanlab_log_completions swanlab_completion_log_interval swanlab_completion_max_buffer diffusion "
        "llmcompressor",
        "ignored",
        "only read by an axolotl plugin (`plugins`), which is refused",
    ),
    # ----- off values accepted, or what shardpool already does --------------------------------
    _keys(
        "pad_to_sequence_len",
        "when_off",
        "rows are always padded to sequence_len (padding is masked out of the loss)",
        accepted=(True,),
    ),
    _keys(
        "excess_length_strategy",
        "when_off",
        "rows longer than sequence_len are truncated; set `excess_length_strategy: truncate`",
        accepted=("truncate",),
    ),
    _keys(
        "sage_attention s2_attention flash_optimum "
        "gemma4_hybrid_attn_impl large_head_attention flash_attn_d512 sdpa_varlen scaling_softmax",
        "when_off",
        "attention uses transformers' sdpa, not this kernel; set it to false or remove it",
    ),
    _keys(
        "lora_mlp_kernel lora_qkv_kernel lora_o_kernel lora_embedding_kernel chunked_cross_entropy "
        "tiled_mlp use_kernels torch_compile fused_attn_kernel flash_attn_cross_entropy flash_attn_rms_norm "
        "flash_attn_fuse_mlp",
        "ignored",
        "a fused or compiled kernel for the same math; shardpool runs the plain layers (same result, its own speed)",
    ),
    _keys(
        "tokenizer_use_fast",
        "when_off",
        "the fast tokenizer is always used; remove it",
        accepted=(True,),
        false_is_off=False,
    ),
    _keys(
        "save_safetensors",
        "when_off",
        "adapters are always written as safetensors; remove it",
        accepted=(True,),
        false_is_off=False,
    ),
    _keys(
        "trust_remote_code",
        "when_off",
        "only architectures transformers ships are built; no code from the model directory is run",
    ),
    _keys(
        "sequence_parallel_degree context_parallel_size tensor_parallel_size dp_shard_size dp_replicate_size",
        "when_off",
        _SHARDS_ITSELF,
        accepted=(1,),
    ),
    _keys(
        "deepspeed deepcompile fsdp fsdp_config fp32_norms fp32_norm_classes fp8_enable_fsdp_float8_all_gather",
        "when_off",
        _SHARDS_ITSELF,
    ),
    _keys(
        "load_in_8bit",
        "when_off",
        "8-bit bases are not supported; use `adapter: qlora` with `load_in_4bit: true`",
    ),
    _keys("gptq", "when_off", "GPTQ bases are not supported; use `adapter: qlora` on an unquantized base"),
    _keys(
        "gptq_groupsize gptq_model_v1 gptq_disable_exllama",
        "ignored",
        "only read with `gptq`, which is refused",
    ),
    _keys(
        "eval_strategy evaluation_strategy save_strategy",
        "when_off",
        "use `save_steps` or `saves_per_epoch`, and `eval_steps` or `evals_per_epoch`",
        accepted=("no",),
    ),
    _keys(
        "wandb_watch wandb_log_model "
        "use_mlflow mlflow_tracking_uri mlflow_experiment_name mlflow_run_name "
        "hf_mlflow_log_artifacts use_comet comet_api_key comet_workspace comet_project_name "
        "comet_experiment_key comet_mode comet_online comet_experiment_config use_trackio "
        "trackio_project_name trackio_run_name trackio_space_id use_otel_metrics",
        "when_off",
        _LOGGING,
    ),
    _keys(
        "hub_model_id hub_strategy hub_revision", "when_off", "pushing to a hub is not supported; remove it"
    ),
    _keys(
        "chat_template_kwargs",
        "when_off",
        "no extra variables are passed to the chat template; remove it",
    ),
    _keys(
        "default_system_message",
        "when_off",
        "no system message is added to conversations; put it in the data",
    ),
    _keys(
        "tokens added_tokens_overrides fix_untrained_tokens resize_token_embeddings_to_32x shrink_embeddings",
        "when_off",
        _TOKENS,
    ),
    _keys(
        "tokenizer_config tokenizer_legacy tokenizer_use_mistral_common processor_type processor_kwargs "
        "base_model_config cls_model_config revision_of_model",
        "when_off",
        "the model and its tokenizer are read from the base_model directory as they are",
    ),
    _keys(
        "lora_modules_to_save lora_fan_in_fan_out lora_target_parameters lora_rank_pattern "
        "lora_alpha_pattern peft_layers_to_transform peft_layers_pattern peft peft_use_dora "
        "peft_use_rslora peft_layer_replication peft_init_lora_weights peft_trainable_token_indices "
        "peft_ensure_weight_tying peft_autocast_adapter_dtype lora_on_cpu loraplus_lr_ratio "
        "unfrozen_parameters",
        "when_off",
        "only plain LoRA on the decoder's Linear layers is trained; remove it",
    ),
    _keys("merge_lora", "when_off", "merging is a separate step, not part of training; remove it"),
    _keys(
        "reward_model process_reward_model", "when_off", "reward models are not trained; use `rl: dpo` or SFT"
    ),
    _keys("group_by_length", "when_off", "rows are batched in shuffled (or file) order; remove it"),
    _keys(
        "early_stopping_patience load_best_model_at_end",
        "when_off",
        "training always runs to max_steps or num_epochs; remove it",
    ),
    _keys(
        "save_only_model save_first_step",
        "when_off",
        "checkpoints follow `save_steps` or `saves_per_epoch`; remove it",
    ),
    _keys("neftune_noise_alpha noisy_embedding_alpha", "when_off", "embedding noise is not built; remove it"),
    _keys("batch_size", "when_off", "set `micro_batch_size` and `gradient_accumulation_steps` instead"),
]

_OTHER_AXOLOTL_KEYS = (
    "model_quantization_config model_quantization_config_kwargs use_onebitllms relora jagged_restart_steps "
    "eval_batch_size auto_find_batch_size embedding_lr embedding_lr_scale optim_args optim_target_modules "
    "torchdistx_path lr_scheduler_kwargs lr_quadratic_warmup cosine_constant_lr_ratio lr_groups "
    "lisa_n_layers lisa_step_interval use_ray image_size role_boundaries overrides_of_model_config "
    "overrides_of_model_kwargs max_packed_sequence_len rope_scaling embeddings_skip_upcast reinit_weights "
    "trainer_cls qat quantization dynamic_checkpoint test_datasets shuffle_before_merging_datasets "
    "dataset_shard_num dataset_shard_idx pretraining_dataset dataset_exact_deduplication "
    "dataloader_drop_last accelerator_config do_causal_lm_eval eval_causal_lm_metrics do_bench_eval "
    "bench_dataset bench_split fp8 bfloat16 float16 float32 selective_checkpointing activation_offloading "
    "layer_offloading freeze_mm_modules eval_sequence_len min_sample_len sample_packing_group_size "
    "sample_packing_bin_size sample_packing_sequentially sample_packing_mp_start_method pad_to_multiple_of "
    "multipack_real_batches batch_flattening use_pose pretraining_sample_concatenation streaming "
    "experts_implementation quantize_moe_experts use_eaft llama4_linearized_experts profiler_steps "
    "generate_samples plugins"
)
_GROUPS.append(_keys(_OTHER_AXOLOTL_KEYS, "when_off", _NOT_BUILT))

#: Every axolotl key that is not a field of Config, by name.
AXOLOTL_KEYS: dict[str, AxolotlKey] = {key.name: key for group in _GROUPS for key in group}
