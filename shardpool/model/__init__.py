"""Models: the single description of a model architecture (model.shape) and building its pipeline stages.

Owns what config.json says about a supported family, NF4 quantization, LoRA settings and
adapters, safetensors reading and writing, pipeline stages and the tiny test model. May import
torch and the ML stack, the layers below it (shardpool.data, .contract, .config, .errors) and mesh;
never train, plan, files, launch or agent.
"""
