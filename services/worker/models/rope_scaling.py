"""RoPE's inverse frequencies under a config's scaling (llama3, linear, YaRN), and YaRN's cos/sin factor.

Each follows transformers' computation step for step (the same float32 operations in the same
order), so a scaled model's logits match transformers' as an unscaled one's do.
"""

from __future__ import annotations

import math

import torch

from services.worker.models.llama_config import (
    LinearRopeScaling,
    Llama3RopeScaling,
    LlamaFamilyConfig,
    YarnRopeScaling,
)


def rope_inv_freq(config: LlamaFamilyConfig, device: torch.device, *, theta: float | None = None,
                  scaled: bool = True) -> torch.Tensor:
    """RoPE's inverse frequency of each rotated pair, `float32[head_size // 2]`, scaled per config; `theta`
    and `scaled=False` give another base's plain frequencies (Gemma 3's sliding layers)."""
    theta = config.rope_theta if theta is None else theta
    exponents = torch.arange(0, config.head_size, 2, dtype=torch.int64, device=device).float() / config.head_size
    scaling = config.rope_scaling if scaled else None
    if isinstance(scaling, YarnRopeScaling):
        return yarn_scaled(theta ** exponents, config.head_size, theta, scaling)
    inv_freq = 1.0 / (theta ** exponents)
    if isinstance(scaling, LinearRopeScaling):
        return inv_freq / scaling.factor
    if isinstance(scaling, Llama3RopeScaling):
        return llama3_scaled(inv_freq, scaling)
    return inv_freq


def rope_attention_factor(config: LlamaFamilyConfig) -> float:
    """What cos and sin are multiplied by (so q·k by its square): YaRN's temperature, else 1."""
    scaling = config.rope_scaling
    return scaling.attention_factor if isinstance(scaling, YarnRopeScaling) else 1.0


def llama3_scaled(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.1's RoPE stretch: wavelengths longer than original_context / low_freq_factor are divided by
    `factor`, those shorter than original_context / high_freq_factor kept, and the band between
    interpolated linearly in original_context / wavelength."""
    original = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    stretched = inv_freq / scaling.factor
    # 0 at the low-frequency edge of the band, 1 at its high-frequency edge.
    blend = (original / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - blend) * stretched + blend * inv_freq
    long = wavelength > original / scaling.low_freq_factor
    short = wavelength < original / scaling.high_freq_factor
    return torch.where(long, stretched, torch.where(short, inv_freq, interpolated))


def yarn_scaled(pos_freqs: torch.Tensor, head_size: int, theta: float, scaling: YarnRopeScaling) -> torch.Tensor:
    """YaRN's blend of each pair's own frequency (1 / pos_freqs, kept where it turns more than beta_fast
    times over the original context) and that frequency divided by `factor` (where it turns fewer
    than beta_slow times), by a linear ramp over the pairs between."""
    original = scaling.original_max_position_embeddings

    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns `turns` times
        return (head_size * math.log(original / (turns * 2 * math.pi))) / (2 * math.log(theta))

    low, high = pair_turning(scaling.beta_fast), pair_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_size - 1)
    if low == high:
        high += 0.001  # a ramp of no width: transformers widens it the same way
    ramp = torch.clamp((torch.arange(head_size // 2, dtype=torch.float32, device=pos_freqs.device) - low)
                       / (high - low), 0, 1)
    kept = 1 - ramp  # 1 where the pair's own frequency is kept
    return (1.0 / (scaling.factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept
