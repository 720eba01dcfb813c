"""Built-in model shapes for benchmarks: random weights built from a transformers config, no download.

The README's benchmark tables use these (``foak bench`` scenarios name them as ``model: llama1b``;
``benchmarks/train_step.py --models`` takes the same names). Each entry: transformers config class, its
arguments, and the batch size and sequence length of the README's tables (a scenario's defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BuiltinModel:
    config_class: str
    dims: dict = field(default_factory=dict)
    batch_size: int = 1
    seq_length: int = 512
    about: str = ""

    def config(self, **overrides):
        import transformers

        return getattr(transformers, self.config_class)(**{**self.dims, **overrides})


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "llama1b": BuiltinModel("LlamaConfig", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=8192),
        4, 4096, "Llama-3.2-1B dims"),
    "llama8b-8l": BuiltinModel("LlamaConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
        2, 4096, "Llama-3-8B dims, 8 layers"),
    "llama8b": BuiltinModel("LlamaConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=1 << 20, rope_theta=500000.0),
        1, 131072, "Llama-3.1-8B dims, all 32 layers (the long-context scenario)"),
    "mixtral-small": BuiltinModel("MixtralConfig", dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=8192), 4, 4096, "Mixtral-like, 8 experts top-2, 8 layers, hidden 2048"),
    # architectures beyond Llama/Mixtral (random weights; full depth where it fits one GPU's training step)
    "mistral7b-8l-swa": BuiltinModel("MistralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, sliding_window=1024, max_position_embeddings=32768),
        2, 4096, "Mistral-7B dims, 8 layers, sliding window 1024"),
    "gemma3-1b": BuiltinModel("Gemma3TextConfig", dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512, query_pre_attn_scalar=256,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2,
        rope_theta=1_000_000.0, max_position_embeddings=32768, tie_word_embeddings=True),
        4, 4096, "Gemma-3-1B dims (26 layers, 5 local (window 512) : 1 global)"),
    "phi3-mini-8l": BuiltinModel("Phi3Config", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=8, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096, original_max_position_embeddings=4096,
        sliding_window=None), 2, 4096, "Phi-3-mini dims, 8 layers"),
    "gptoss-8l": BuiltinModel("GptOssConfig", dict(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=8, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, vocab_size=201088, num_local_experts=16, num_experts_per_tok=4,
        sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 4,
        max_position_embeddings=131072, router_aux_loss_coef=0.0),
        2, 2048, "gpt-oss-20b dims cut to fit: 8 layers, 16 of 32 experts (top-4), window 128 alternating"),
    "qwen35-8l": BuiltinModel("Qwen3_5TextConfig", dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=4, head_dim=256, vocab_size=248320,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        max_position_embeddings=32768), 2, 4096,
        "Qwen3.5-like hybrid: hidden 4096, 8 layers (6 gated-delta-net : 2 full attention)"),
    # CPU smoke tests of the code paths
    "tiny": BuiltinModel("LlamaConfig", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=301, max_position_embeddings=256), 2, 64, "tiny Llama (CPU smoke tests)"),
    "tiny-mixtral": BuiltinModel("MixtralConfig", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=301, max_position_embeddings=256), 2, 64,
        "tiny Mixtral (CPU smoke tests)"),
}
