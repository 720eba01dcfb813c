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
    "mixtral-small": BuiltinModel("MixtralConfig", dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=8192), 4, 4096, "Mixtral-like, 8 experts top-2, 8 layers, hidden 2048"),
    # CPU smoke tests of the code paths
    "tiny": BuiltinModel("LlamaConfig", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=301, max_position_embeddings=256), 2, 64, "tiny Llama (CPU smoke tests)"),
    "tiny-mixtral": BuiltinModel("MixtralConfig", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=301, max_position_embeddings=256), 2, 64,
        "tiny Mixtral (CPU smoke tests)"),
}
