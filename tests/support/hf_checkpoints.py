"""Tiny random-weight Hugging Face checkpoints of the Llama family (Llama, Qwen2, Qwen3, Mistral, Phi-3,
Granite, SmolLM3, OLMo 2, Gemma 2 and 3, Gemma 3 with its vision tower, and the mixtures of experts
Qwen3-MoE, Mixtral and Qwen2-MoE), made with transformers (tests only).

`save_tiny_checkpoint(dir, "qwen2")` writes what a user would bring (config.json,
model.safetensors, generation_config.json) via `save_pretrained`; nothing is
downloaded. Weights are drawn wider than transformers' init (std 0.02 gives
near-uniform logits, where greedy decoding flips on float noise) and biases
are drawn too (transformers zeroes them, which would test nothing).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never reach the Hub

import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

# Shared by every family: 2 layers, hidden 64, 4 heads over 2 KV heads (GQA), vocab 512.
BASE: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)
# family → (config class, model class, config overrides). llama3's original context of 64 puts the tiny
# head's wavelengths on all three sides of its band (kept, interpolated, divided by factor).
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 10000.0}),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1000000.0}),
    # Qwen2.5's long-context YaRN (factor 4 over an original context of 64 here: the head's pairs fall
    # on both ends of the ramp and on it), and Llama 2 style linear interpolation.
    "qwen2_yarn": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1000000.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
    "llama_linear": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # Qwen3's config class defaults head_dim to 128 whatever the width: this one's is 32 (q is 128
    # wide over a 64-wide model), and its embeddings are tied, as Qwen3-0.6B's are.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"rope_theta": 1000000.0, "head_dim": 32,
                                                  "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 256, "head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"rope_theta": 10000.0}),  # q/k/v and gate/up stored fused
    # OLMo 2: norms after each branch, q/k norms over the whole projection.
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"rope_theta": 500000.0}),
    # SmolLM3 leaves every no_rope_layer_interval-th layer unrotated: here the second of two.
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layer_interval": 2}),
    # Gemma 3: layer 0 slides over 8 tokens with its own RoPE base, layer 1 is full with linear scaling
    # (Gemma 3 4B's shape, in small); query_pre_attn_scalar apart from head_dim, so the scale is read.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8, "sliding_window_pattern": 2,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        "attn_implementation": "eager"}),
    # Gemma 2: both softcaps, small enough to bend these weights' scores and logits (released: 50 and 30).
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8, "attn_logit_softcapping": 3.0,
        "final_logit_softcapping": 8.0, "attn_implementation": "eager"}),
    # Mistral 7B v0.1's sliding window on every layer, shorter than the tests' sequences.
    "mistral_window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 12, "head_dim": 16}),
    # Granite's four scalings, none of them 1 (Granite 3's are 12, 0.22, 1/128 and 16 at full size).
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"embedding_multiplier": 4.0, "residual_multiplier": 0.5,
                                                        "attention_multiplier": 0.2, "logits_scaling": 2.0}),
    # Mixtures of experts, saved per expert as released. Qwen3-MoE (Qwen3-30B-A3B's routing: the top
    # k renormalized) with its second layer dense by mlp_only_layers; Mixtral (8x7B's 8 experts, top 2,
    # in small) on every layer; Qwen2-MoE (Qwen1.5-MoE's: top 4 not renormalized, a gated shared expert).
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "rope_theta": 1000000.0, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "rope_theta": 1000000.0, "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "rope_theta": 1000000.0, "num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 96, "norm_topk_prob": False}),
}


# Vision + text checkpoints, served text-only; not in FAMILIES (their tests are their own): family →
# (config class, model class, the text_config's family, the vision config's class and fields). Gemma 3
# 4B and up as released, around a SigLIP as small as it goes: one layer, a 28-pixel image in four
# 14-pixel patches (mm_tokens_per_image 4: one token a patch).
VISION_FAMILIES: dict[str, tuple[str, str, str, str, dict[str, Any]]] = {
    "gemma3_vision": ("Gemma3Config", "Gemma3ForConditionalGeneration", "gemma3", "SiglipVisionConfig", {
        "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "image_size": 28, "patch_size": 14}),
}


def hf_config(family: str, **overrides: Any) -> transformers.PretrainedConfig:
    """`family`'s config; a vision family's `overrides` are its text_config's."""
    if family in VISION_FAMILIES:
        config_class, _, text_family, vision_class, vision = VISION_FAMILIES[family]
        return getattr(transformers, config_class)(
            text_config=hf_config(text_family, **overrides), vision_config=getattr(transformers, vision_class)(**vision),
            mm_tokens_per_image=4, attn_implementation="eager")
    config_class, _, extra = FAMILIES[family]
    return getattr(transformers, config_class)(**{**BASE, **extra, **overrides})


def tiny_model(family: str, *, seed: int = 0, std: float = 0.25, **overrides: Any) -> transformers.PreTrainedModel:
    """A random-weight model of `family` (FAMILIES or VISION_FAMILIES) in eval mode, float32."""
    model_class = VISION_FAMILIES[family][1] if family in VISION_FAMILIES else FAMILIES[family][1]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(hf_config(family, **overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)  # not all ones: a norm's weight must be read, not assumed
            else:
                param.normal_(0.0, std)
    return model.eval()


def save_tiny_checkpoint(directory: str | Path, family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                         std: float = 0.25, **overrides: Any) -> transformers.PreTrainedModel:
    """Saves a tiny `family` checkpoint into `directory` (stored as `dtype`); returns the float32 model
    with the weights as stored (rounded to `dtype`)."""
    model = tiny_model(family, seed=seed, std=std, **overrides)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(dtype))  # round; buffers (RoPE's frequencies) stay float32
    copy.deepcopy(model).to(dtype).save_pretrained(directory)
    return model


# A Llama 3 style chat template (the shape of Meta's, shortened): what `infermesh models import` pins.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# The byte-level BPE's special ids (tests/unit/scheduler/hf_tokenizer_files.py): the model's ids match them.
BOS_ID, END_OF_TEXT_ID, EOT_ID = 0, 1, 4


def save_model_directory(directory: str | Path, family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                         std: float = 0.25, chat_template: str | None = None, added_tokens: Sequence[str] = (),
                         **overrides: Any) -> transformers.PreTrainedModel:
    """A whole checkpoint directory as a user brings it: the tiny model (save_tiny_checkpoint), a
    byte-level BPE trained on local text (tokenizer.json, tokenizer_config.json, the chat template:
    CHAT_TEMPLATE unless given), and generation_config.json ending on <|end_of_text|> or <|eot_id|>.
    `added_tokens`: plain-text tokens added after the BPE's ids (Qwen3's `<think>` and `</think>`).
    Returns the float32 model."""
    from tests.unit.scheduler.hf_tokenizer_files import byte_level_json

    model = save_tiny_checkpoint(directory, family, seed=seed, dtype=dtype, std=std, **{
        "bos_token_id": BOS_ID, "eos_token_id": [END_OF_TEXT_ID, EOT_ID], "pad_token_id": END_OF_TEXT_ID,
        **overrides})
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer.from_str(byte_level_json().decode()),
        bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|end_of_text|>")
    tokenizer.add_tokens(list(added_tokens))
    tokenizer.chat_template = CHAT_TEMPLATE if chat_template is None else chat_template
    tokenizer.save_pretrained(directory)
    return model
