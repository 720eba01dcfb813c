"""The architecture matrix: every model type foak serves beyond the nine of tests/test_patching.py.

For each type: a tiny randomly initialised model built from transformers' own config class (2 layers, small
dims, MoE with >= 3 experts, a sliding window shorter than the batches where the architecture has one),
patched with foak's defaults vs an unpatched deepcopy: loss and every parameter gradient within 1e-5 (fp32)
on a left-padded batch, an unpadded batch and a packed batch; the same with PEFT LoRA on every linear layer;
the report's rows (rule id -> modules) as the table below expects them, a reason on every row that patched
nothing, and foak's ops counted while the patched model runs.

The matrix runs foak's torch reference ops (``foak.set_backend("reference")``): the replacement forwards and
the op calls are the same on either backend, and every kernel branch has its interpreter tests beside its op.
An entry with ``kernels=True`` runs the Triton kernels (in the interpreter here) for the architectures whose
kernel variants appear nowhere else in a model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch
import transformers
from torch import nn

import foak
from test_patching import assert_close, loss_and_grads  # the first nine's comparisons
from foak.patching import moe as moe_patching
from foak.patching import replacements
from foak.testing import relative_error

TOL = 1e-5
VOCAB = 301
WINDOW = 4  # sliding window of the architectures that have one: shorter than every batch below

COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
MOE = {"num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.1}


# Gemma 1/2/3: (1 + w) norms (with Gemma 3's q/k norms), RoPE, GeGLU MLP, both losses, packed attention
GEMMA_ROWS = {"rms_norm": 2 * 2 + 1, "rms_norm_recompute": 1, "fused_lora_qkv": 0, "rope": 2, "swiglu": 2,
              "fused_linear_loss": 1, "packed_attention": 1, "fused_lora": 0}

# a local (sliding-window) and a global layer, the window shorter than the batches; q/k norms; softcapped head
GEMMA3_TEXT = {**COMMON, "head_dim": 16, "sliding_window": WINDOW, "final_logit_softcapping": 3.0,
               "layer_types": ["sliding_attention", "full_attention"]}
# the vision tower of the multimodal configs: 16x16 images of 4x4 patches
TINY_SIGLIP = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
               "image_size": 16, "patch_size": 4}

# Gemma 4's quirks at once: a local and two global layers (the last one reusing the second's K/V, with a
# double-wide MLP; the global ones with k as v and a wider head), per-layer inputs, a MoE block beside each
# MLP, a softcapped head. Heads of 8 / 16: Gemma 4 scales its attention logits by 1 (q/k norms instead), so
# with wider heads the softmax saturates and the fp32 LoRA gradients lose digits on both sides (unpatched vs
# patched packed ~7e-4 at 16 / 32; equal to 1e-15 in fp64, where foak's ops are not defined)
GEMMA4_TEXT = {**COMMON, "num_hidden_layers": 3, "head_dim": 8, "global_head_dim": 16, "sliding_window": WINDOW,
               "layer_types": ["sliding_attention", "full_attention", "full_attention"],
               "num_kv_shared_layers": 1, "use_double_wide_mlp": True, "attention_k_eq_v": True,
               "num_global_key_value_heads": 1, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB,
               "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32,
               "final_logit_softcapping": 3.0}
# norms: 4 per layer, q/k/v (q only in the sharing layer), the per-layer input's, the MoE block's 4 (router
# included), the stack's and the per-layer projection's
GEMMA4_ROWS = {"rms_norm": 3 * (4 + 1 + 4) + 2 * 3 + 1 + 2, "rms_norm_recompute": 1, "fused_lora_qkv": 0, "rope": 3,
               "swiglu": 3, "moe": 3, "fused_linear_loss": 1, "packed_attention": 1, "fused_lora": 0}
VISION_NORMS = 4 + 3 + 1  # the tiny vision tower: one layer (4 norms, q/k/v norms), the embedder's norm
TINY_GEMMA4_VISION = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                      "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4, "pooling_kernel_size": 2,
                      "position_embedding_size": 64}


@dataclass
class Spec:
    config: str  # transformers' config class
    model: str  # the class a user loads (AutoModelForCausalLM's, or the multimodal ...ForConditionalGeneration)
    kwargs: dict
    # rule id without the "<model_type>." prefix -> modules the report says it patched (0: a row that says why)
    rows: dict
    kernels: bool = False  # run the Triton kernels instead of foak's reference ops
    batches: tuple = ("padded", "unpadded", "packed")
    lora: bool = True  # also compare with PEFT LoRA on every linear layer
    # ill-conditioned in fp32 (Gemma 4's attention scale of 1; Qwen3.5's gated delta net: A_log, dt_bias amplify
    # rounding 100-1000x, so another CPU's BLAS may move them past 1e-5): see assert_grads_close
    fp64_arbiter: bool = False
    extra: dict = field(default_factory=dict)  # notes for a reader; not used by the tests
    model_type: str | None = None  # the model's config.model_type where it is not the entry's key

# ---- Qwen3.5 hybrids: shared settings ----
QWEN3_5 = {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"], "linear_key_head_dim": 8,
           "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4}
QWEN3_5_MOE = {**MOE, "num_experts": 4, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 32}
QWEN3_5_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64,
                  "patch_size": 4, "num_position_embeddings": 16}
# rms_norm: 2 per layer, q_norm, k_norm, the final norm; swiglu: the dense MLPs or the MoE's shared experts
QWEN3_5_ROWS = {"rms_norm": 7, "rms_norm_gated": 1, "rms_norm_recompute": 1, "fused_lora_qkv": 0, "rope": 1,
                "swiglu": 2, "fused_linear_loss": 1, "packed_attention": 1, "fused_lora": 0}
# ---- end of Qwen3.5 hybrids' shared settings ----

# ---- ministral3: YaRN RoPE, Llama 4's q scale 1 + 0.1 log(1 + floor(position / 4)) ----
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "original_max_position_embeddings": 4,
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "llama_4_scaling_beta": 0.1}
# ---- end of ministral3's shared settings ----

SPECS: dict[str, Spec] = {
    # ---- dense decoders (phi3, glm4, olmo2, olmo3, smollm3, ministral) ----
    "phi3": Spec("Phi3Config", "Phi3ForCausalLM", {**COMMON, "partial_rotary_factor": 0.5, "sliding_window": WINDOW},
                 {"rms_norm": 5, "rms_norm_recompute": 1, "fused_lora_qkv": 0, "rope": 2, "swiglu": 2,
                  "fused_linear_loss": 1, "packed_attention": 1, "fused_lora": 0},
                 extra={"fused_lora_qkv": "one qkv_proj: fused_lora fuses it as one layer",
                        "swiglu": "fused gate_up_proj (fused_glu_mlp_rule)", "rope": "partial rotary 0.5"}),
    "glm4": Spec("Glm4Config", "Glm4ForCausalLM", dict(COMMON),  # partial_rotary_factor 0.5 by default
                 {"rms_norm": 9, "rms_norm_recompute": 1, "fused_lora_qkv": 0, "rope": 2, "swiglu": 2,
                  "fused_linear_loss": 1, "packed_attention": 1, "fused_lora": 0},
                 extra={"rope": "interleaved pairs, partial rotary", "rms_norm": "4 per layer (2 post-norms)"}),
    "olmo2": Spec("Olmo2Config", "Olmo2ForCausalLM", dict(COMMON),
                  {"rms_norm": 9, "rms_norm_recompute": 1, "fused_lora_qkv": 0, "rope": 2, "swiglu": 2,
                   "fused_linear_loss": 1, "packed_attention": 1, "fused_lora": 0},
                  extra={"rms_norm": "post-norms + q_norm/k_norm over the whole projection, mode 'olmo'"}),
    "olmo3": Spec("Olmo3Config", "Olmo3ForCausalLM",
                  {**COMMON, "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
                  {"rms_norm": 9, "rms_norm_recompute": 1, "fused_lora_qkv": 0, "rope": 2, "swiglu": 2,
                   "fused_linear_loss": 1, "packed_attention": 1, "fused_lora": 0}),
    "smollm3": Spec("SmolLM3Config", "SmolLM3ForCausalLM",
                    {**COMMON, "no_rope_layers": [1, 0], "use_sliding_window": True, "sliding_window": WINDOW},
                    {"rms_norm": 5, "rms_norm_recompute": 1, "fused_lora_qkv": 0, "rope": 1, "swiglu": 2,
                     "fused_linear_loss": 1, "packed_attention": 1, "fused_lora": 0},
                    extra={"rope": "layer 1 is a NoPE layer (and sliding): counted as not patched"}),
    "ministral": Spec("MinistralConfig", "MinistralForCausalLM",
                      {**COMMON, "head_dim": 16, "sliding_window": WINDOW,
                       "layer_types": ["sliding_attention", "full_attention"]},
                      {"rms_norm": 5, "rms_norm_recompute": 1, "fused_lora_qkv": 0, "rope": 2, "swiglu": 2,
                       "fused_linear_loss": 1, "packed_attention": 1, "fused_lora": 0}),

    # ---- Gemma family and multimodal text towers (gemma*, mistral3) ----
    "gemma": Spec("GemmaConfig", "GemmaForCausalLM", {**COMMON, "head_dim": 16}, GEMMA_ROWS),
    "gemma2": Spec("Gemma2Config", "Gemma2ForCausalLM",  # final and attention-logit softcaps on (their defaults)
                   {**COMMON, "head_dim": 16, "sliding_window": WINDOW, "final_logit_softcapping": 3.0},
                   {**GEMMA_ROWS, "rms_norm": 4 * 2 + 1, "packed_attention": 0}),
    "gemma3_text": Spec("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3_TEXT,
                        {**GEMMA_ROWS, "rms_norm": 6 * 2 + 1}),
    "gemma3": Spec("Gemma3Config", "Gemma3ForConditionalGeneration",  # (+1 norm: the projector's)
                   {"text_config": GEMMA3_TEXT, "vision_config": TINY_SIGLIP, "mm_tokens_per_image": 4},
                   {**GEMMA_ROWS, "rms_norm": 6 * 2 + 1 + 1}),
    "gemma4_text": Spec("Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4_TEXT, GEMMA4_ROWS, fp64_arbiter=True),
    "gemma4": Spec("Gemma4Config", "Gemma4ForConditionalGeneration",  # MoE: gemma4_text's (with it, this init's
                   # fp32 LoRA gradients lose digits on both sides: 1.2e-5)
                   {"text_config": {**GEMMA4_TEXT, "enable_moe_block": False}, "vision_config": TINY_GEMMA4_VISION},
                   {**GEMMA4_ROWS, "rms_norm": GEMMA4_ROWS["rms_norm"] - 3 * 4 + VISION_NORMS, "moe": 0},
                   fp64_arbiter=True),
    "mistral3": Spec("Mistral3Config", "Mistral3ForConditionalGeneration",  # its text tower: a Mistral model
                     {"text_config": {**COMMON, "model_type": "mistral", "sliding_window": WINDOW},
                      "vision_config": {**TINY_SIGLIP, "model_type": "pixtral", "head_dim": 16}},
                     GEMMA_ROWS),

    # ---- MoE (qwen2_moe, glm4_moe, deepseek_v3, llama4, granitemoeshared) ----
    # layer 0 dense (mlp_only_layers), layer 1 sparse with the shared expert and its sigmoid gate
    "qwen2_moe": Spec("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                      {**COMMON, **MOE, "num_experts": 4, "moe_intermediate_size": 48,
                       "shared_expert_intermediate_size": 80, "mlp_only_layers": [0]},
                      {"rms_norm": 5, "rms_norm_recompute": 1, "fused_lora_qkv": 0, "rope": 2, "swiglu": 2,
                       "fused_linear_loss": 1, "packed_attention": 1, "moe": 1, "fused_lora": 0}),
    # layer 0 dense (first_k_dense_replace), layer 1 sparse with shared experts; grouped sigmoid routing; partial
    # rotary (half of each head); q_norm / k_norm
    "glm4_moe": Spec("Glm4MoeConfig", "Glm4MoeForCausalLM",
                     {**COMMON, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                      "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
                      "routed_scaling_factor": 2.5, "use_qk_norm": True},
                     {"rms_norm": 9, "rms_norm_recompute": 1, "fused_lora_qkv": 0, "rope": 2, "swiglu": 2,
                      "fused_linear_loss": 1, "packed_attention": 1, "moe": 1, "fused_lora": 0}),
    # MLA (q_lora_rank / kv_lora_rank, q_a_layernorm / kv_a_layernorm, v head dim != qk head dim), interleaved
    # RoPE on the rotary part of q/k; layer 0 dense, layer 1 sparse with shared experts; grouped sigmoid routing
    "deepseek_v3": Spec("DeepseekV3Config", "DeepseekV3ForCausalLM",
                        {**COMMON, "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 48, "n_shared_experts": 1, "first_k_dense_replace": 1,
                         "n_group": 2, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 24,
                         "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12, "rope_interleave": True},
                        {"rms_norm": 9, "rms_norm_recompute": 1, "fused_lora_qkv": 0, "rope": 2, "swiglu": 2,
                         "fused_linear_loss": 1, "packed_attention": 1, "moe": 1, "fused_lora": 0}),
    # DeepSeek's MLA with GLM-4-MoE's experts; mlp_layer_types: layer 0 dense, layer 1 sparse
    "glm4_moe_lite": Spec("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM",
                          {**COMMON, "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                           "moe_intermediate_size": 48, "n_shared_experts": 1, "mlp_layer_types": ["dense", "sparse"],
                           "n_group": 2, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 24,
                           "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12, "rope_interleave": True},
                          {"rms_norm": 9, "rms_norm_recompute": 1, "fused_lora_qkv": 0, "rope": 2, "swiglu": 2,
                           "fused_linear_loss": 1, "packed_attention": 1, "moe": 1, "fused_lora": 0}),
    # GraniteMoE (multipliers, logits_scaling) with a shared expert whose gate|up rows are one input_linear
    "granitemoeshared": Spec("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
                             {**COMMON, **MOE, "num_local_experts": 4, "shared_intermediate_size": 80,
                              "logits_scaling": 3.0, "residual_multiplier": 0.5, "embedding_multiplier": 2.0,
                              "attention_multiplier": 0.2},
                             {"rms_norm": 5, "rms_norm_recompute": 1, "fused_lora_qkv": 0, "rope": 2,
                              "fused_linear_loss": 1, "packed_attention": 1, "swiglu": 2, "moe": 2, "fused_lora": 0}),
    # Llama4ForCausalLM: layer 0 dense with RoPE + qk L2 norm + chunked attention (chunk shorter than the batches),
    # layer 1 MoE (router scores scale the experts' inputs; shared expert) without RoPE (temperature tuning)
    "llama4_text": Spec("Llama4TextConfig", "Llama4ForCausalLM",
                        {**COMMON, **MOE, "intermediate_size": 48, "intermediate_size_mlp": 96, "head_dim": 16,
                         "num_local_experts": 4, "interleave_moe_layer_step": 2, "no_rope_layer_interval": 2,
                         "attention_chunk_size": WINDOW},
                        {"rms_norm": 5, "rms_norm_recompute": 1, "fused_lora_qkv": 0, "rope": 0, "qk_norm": 0,
                         "swiglu": 2, "fused_linear_loss": 1, "packed_attention": 0, "moe": 1, "fused_lora": 0},
                        # PEFT's all-linear wraps Llama4Router (an nn.Linear returning a tuple) and fails unpatched
                        # too: tests/test_arch_moe.py runs LoRA on every other linear layer
                        lora=False),

    # ---- gpt-oss ----
    # experts through fast_moe (clamped SwiGLU, interleaved gate/up, transposed weights, biases); attention
    # with its sinks through foak's varlen attention (every layer, alternating sliding/full). transformers'
    # gpt-oss builds its masks without the position ids (its packed sequences see each other): the unpatched
    # reference gets them passed (ref_loss_and_grads, as foak verify does)
    "gpt_oss": Spec("GptOssConfig", "GptOssForCausalLM",
                    {**COMMON, **MOE, "num_local_experts": 4, "head_dim": 16, "sliding_window": WINDOW,
                     "layer_types": ["sliding_attention", "full_attention"],
                     "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "rope_theta": 150000.0,
                                         "original_max_position_embeddings": 2}},  # gpt-oss's YaRN, 64 = 32 x 2
                    rows={"rms_norm": 5, "rms_norm_recompute": 1, "fused_lora_qkv": 0, "rope": 2,
                          "fused_linear_loss": 1, "packed_attention": 1, "moe": 2, "fused_lora": 0}),

    # ---- Qwen3.5 hybrids ----
    # AutoModelForCausalLM loads the text model (model_type qwen3_5_text), AutoModelForImageTextToText the
    # multimodal one (qwen3_5); one linear-attention (gated delta net) layer and one full-attention layer
    "qwen3_5_text": Spec("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {**COMMON, **QWEN3_5}, QWEN3_5_ROWS,
                         fp64_arbiter=True),
    "qwen3_5": Spec("Qwen3_5Config", "Qwen3_5ForConditionalGeneration",
                    {"text_config": {**COMMON, **QWEN3_5}, "vision_config": QWEN3_5_VISION, "pad_token_id": 2},
                    QWEN3_5_ROWS, fp64_arbiter=True),
    "qwen3_5_moe_text": Spec("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {**COMMON, **QWEN3_5, **QWEN3_5_MOE},
                             {**QWEN3_5_ROWS, "moe": 2}, fp64_arbiter=True),
    "qwen3_5_moe": Spec("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration",
                        {"text_config": {**COMMON, **QWEN3_5, **QWEN3_5_MOE}, "vision_config": QWEN3_5_VISION,
                         "pad_token_id": 2}, {**QWEN3_5_ROWS, "moe": 2}, fp64_arbiter=True),

    # ---- ministral3 ----
    # YaRN RoPE with Llama 4's q scaling by position (its period shorter than the batches), one sliding window
    "ministral3": Spec("Ministral3Config", "Ministral3ForCausalLM",
                       {**COMMON, "head_dim": 16, "sliding_window": WINDOW, "rope_parameters": MINISTRAL3_ROPE},
                       {"rms_norm": 5, "rms_norm_recompute": 1, "fused_lora_qkv": 0, "rope": 2, "swiglu": 2,
                        "fused_linear_loss": 1, "packed_attention": 1, "fused_lora": 0}),
    # a Mistral 3 checkpoint whose text_config is ministral3: its text tower is a Ministral3Model
    "mistral3_ministral3": Spec("Mistral3Config", "Mistral3ForConditionalGeneration",
                                {"text_config": {**COMMON, "model_type": "ministral3", "head_dim": 16,
                                                 "sliding_window": WINDOW, "rope_parameters": MINISTRAL3_ROPE},
                                 "vision_config": {**TINY_SIGLIP, "model_type": "pixtral", "head_dim": 16}},
                                GEMMA_ROWS, model_type="mistral3"),
}
ARCHS = list(SPECS)


def model_type(arch: str) -> str:
    return SPECS[arch].model_type or arch


def build(arch: str, seed: int = 0) -> nn.Module:
    spec = SPECS[arch]
    config = getattr(transformers, spec.config)(**spec.kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model)(config).float()
    assert model.config.model_type == model_type(arch), (model.config.model_type, arch)
    return model


_PATCHED: list[nn.Module] = []


@pytest.fixture(autouse=True)
def _restore_patched_models():
    yield
    foak.set_backend("auto")
    while _PATCHED:
        foak.restore(_PATCHED.pop())


def patch(model: nn.Module, arch: str, **switches):
    foak.set_backend("auto" if SPECS[arch].kernels else "reference")
    _PATCHED.append(model)
    return foak.patch(model, **switches)


# ---- inputs ---------------------------------------------------------------------------------------------


def batch_of(kind: str) -> dict:
    g = torch.Generator().manual_seed(1)
    if kind == "padded":  # left padding (row 0: 1 pad, row 1: 4 pads), labels -100 at the pads
        ids = torch.randint(3, VOCAB, (2, 11), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :1] = 0
        mask[1, :4] = 0
        ids = ids.masked_fill(mask == 0, 2)
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    if kind == "unpadded":  # no attention mask at all: what a packed-to-length SFT batch looks like
        ids = torch.randint(3, VOCAB, (2, 10), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}
    if kind == "packed":  # padding-free packing: position ids restart per sequence, no attention mask
        lengths = (5, 9, 3)
        ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=g)
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        return {"input_ids": ids, "position_ids": pos, "labels": ids.masked_fill(pos == 0, -100),
                "use_cache": False}
    raise AssertionError(kind)


# ---- comparisons ----------------------------------------------------------------------------------------


def ref_loss_and_grads(ref: nn.Module, batch: dict):
    """loss_and_grads of the unpatched model; on a packed batch transformers' mask builders get the position ids
    where the model passes none (gpt-oss), so that its packed sequences attend per sequence (foak.verify)."""
    from foak.verify import _masks_see_packing

    with _masks_see_packing(ref, batch):
        return loss_and_grads(ref, batch)


def fp64_gradients(ref: nn.Module, batch: dict) -> dict:
    """The unpatched model's gradients in fp64 (its experts on transformers' eager loop: grouped_mm takes no fp64)."""
    exact = copy.deepcopy(ref).double()
    for m in exact.modules():
        config = getattr(m, "config", None)
        if getattr(config, "_experts_implementation", None) not in (None, "eager"):
            config._experts_implementation = "eager"
    return ref_loss_and_grads(exact, batch)[1]


def assert_grads_close(grads: dict, ref_grads: dict, what: str, exact=None):
    """Every gradient within TOL of the unpatched model's; with ``exact()`` (the unpatched model's fp64
    gradients, computed when first needed), one that misses it passes when it is no farther from the fp64
    gradient than FP64_ARBITER_FACTOR x the unpatched fp32 one is (foak verify's arbiter). Where the unpatched
    fp32 gradient is itself accurate (within TOL / 2 of fp64), at most a quarter of the parameters may need the
    arbiter; where it is not, its own rounding is of TOL's order and varies with the CPU's BLAS kernels (Gemma-4's
    padded LoRA step: 13 of 50 gradients off fp64 by 7e-6 to 5e-5 on an AVX2 EPYC, fewer elsewhere)."""
    from foak.verify import FP64_ARBITER_FACTOR

    assert grads.keys() == ref_grads.keys()
    compared = arbitrated = 0  # arbitrated: where the fp32 reference was accurate
    grads64 = None
    for name, g in grads.items():
        r = ref_grads[name]
        if g is None and r is None:
            continue
        assert g is not None and r is not None, f"{what}: grad of {name} is None on one side only"
        if exact is not None and relative_error(g, r) > TOL:
            grads64 = exact() if grads64 is None else grads64
            g64 = grads64[name].float()
            own = relative_error(r, g64)
            assert_close(g, g64, f"{what}: grad of {name} vs fp64", tol=FP64_ARBITER_FACTOR * max(own, TOL))
            arbitrated += own < TOL / 2
        else:
            assert_close(g, r, f"{what}: grad of {name}")
        compared += 1
    assert compared > 0 and arbitrated <= compared // 4, (compared, arbitrated)


_OPS = ("rms_norm", "rope", "glu", "glu_linear", "linear_cross_entropy", "cross_entropy")


@pytest.fixture
def op_calls(monkeypatch):
    """Counts the calls of foak's ops made by the replacement forwards (they look the ops up at call time)."""
    calls = dict.fromkeys((*_OPS, "moe_experts"), 0)

    def counting(module, name):
        fn = getattr(module, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    for name in _OPS:
        counting(replacements, name)
    counting(moe_patching, "moe_experts")
    return calls


def rows_of(report, arch: str) -> dict[str, int]:
    prefix = f"{arch}."
    assert all(r.rule_id.startswith(prefix) for r in report.results), str(report)
    return {r.rule_id[len(prefix):]: r.modules for r in report.results}


# ---- the matrix ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_patched_matches_unpatched(arch, op_calls):
    model = build(arch)
    ref = copy.deepcopy(model)
    report = patch(model, arch)
    for kind in SPECS[arch].batches:
        batch = batch_of(kind)
        out, grads = loss_and_grads(model, batch)
        ref_out, ref_grads = ref_loss_and_grads(ref, batch)
        if "fused_linear_loss" in SPECS[arch].rows and SPECS[arch].rows["fused_linear_loss"]:
            assert out.logits is None  # training with labels: the logits are never materialised
        if getattr(ref_out, "aux_loss", None) is not None:  # the router's aux loss is part of the loss
            assert_close(out.aux_loss, ref_out.aux_loss, f"{arch} {kind} aux loss")
        assert_close(out.loss, ref_out.loss, f"{arch} {kind} loss")
        exact = (lambda: fp64_gradients(ref, batch)) if SPECS[arch].fp64_arbiter else None
        assert_grads_close(grads, ref_grads, f"{arch} {kind}", exact)
    rows = SPECS[arch].rows
    # every kind of op the report says it installed ran
    expected_ops = {"rms_norm": rows.get("rms_norm", 0) > 0, "rope": rows.get("rope", 0) > 0,
                    "linear_cross_entropy": rows.get("fused_linear_loss", 0) > 0,
                    "moe_experts": rows.get("moe", 0) > 0}
    for op, ran in expected_ops.items():
        assert (op_calls[op] > 0) == ran, (op, op_calls, str(report))
    if rows.get("swiglu", 0):
        assert op_calls["glu_linear"] + op_calls["glu"] > 0, (op_calls, str(report))


@pytest.mark.parametrize("arch", ARCHS)
def test_report_rows(arch):
    model = build(arch)
    report = patch(model, arch)
    assert report.model_type == model_type(arch)
    assert rows_of(report, model_type(arch)) == SPECS[arch].rows, str(report)
    for r in report.results:
        if r.modules:
            assert r.backend != "-", str(report)
        else:  # reported, never silent
            assert r.backend == "-" and r.note, f"{r.rule_id} patched nothing without saying why\n{report}"


@pytest.mark.parametrize("arch", [a for a in ARCHS if SPECS[a].lora])
def test_lora_patched_matches_peft(arch):
    peft = pytest.importorskip("peft")
    model = build(arch)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                             init_lora_weights=False)
    model = peft.get_peft_model(model, config)
    ref = copy.deepcopy(model)
    report = patch(model, arch)
    fused = [r for r in report.results if r.switch == "lora" and r.modules]
    assert fused, f"no LoRA layer was fused\n{report}"
    for kind in ("padded", "packed"):
        batch = batch_of(kind)
        out, grads = loss_and_grads(model, batch)
        ref_out, ref_grads = ref_loss_and_grads(ref, batch)
        assert_close(out.loss, ref_out.loss, f"{arch} LoRA {kind} loss")
        exact = (lambda: fp64_gradients(ref, batch)) if SPECS[arch].fp64_arbiter else None
        assert_grads_close(grads, ref_grads, f"{arch} LoRA {kind}", exact)
