"""RoPE's inverse frequencies, unscaled or scaled for a context longer than pretrained (model.rope_scaling).

Pure functions of the config, written in the operation order of transformers' modeling_rope_utils.py so that the
tables are the same to the bit (an imported Llama 3.1 computes transformers' logits exactly; tests/model/test_rope.py
compares with `_compute_llama3_parameters` and `_compute_yarn_parameters` themselves).
"""

import math
from typing import Optional, Tuple

import torch

from lit_pretrain.model.config import RopeScalingConfig


def default_inv_freq(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """1 / theta^(2i/Q), i < Q/2 (Su et al. 2021, eq. 15). (Q/2,) fp32.

    1 / theta^(2i/Q) as transformers' Llama writes it, not theta^(-2i/Q), which rounds differently in the last bit."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_seq_len: int) -> torch.Tensor:
    """Llama 3.1's scaling (Meta's llama-models `apply_scaling`; transformers' `_compute_llama3_parameters`).

    A frequency whose wavelength 2π/f is shorter than original_seq_len / high_freq_factor turns many times inside
    the pretrained context and is kept; one longer than original_seq_len / low_freq_factor never completed a turn
    there and is divided by factor (position interpolation, Chen et al. 2023); between them the two are blended
    linearly in original_seq_len / wavelength."""
    low_freq_wavelen = original_seq_len / low_freq_factor
    high_freq_wavelen = original_seq_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # (Q/2,)
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_attention_factor(factor: float, attention_factor: Optional[float] = None) -> float:
    """YaRN's cos/sin multiplier sqrt(1/t) = 0.1 ln(s) + 1 (Peng et al. 2023, eq. 22; transformers'
    `yarn_get_mscale`), unless given; 1 at s <= 1."""
    if attention_factor is not None:
        return attention_factor
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def yarn_inv_freq(head_dim: int, theta: float, factor: float, original_seq_len: int, beta_fast: float,
                  beta_slow: float, device: torch.device | None = None) -> torch.Tensor:
    """YaRN's "NTK-by-parts" frequencies (Peng et al. 2023, §3.2 eq. 17-18; transformers' `_compute_yarn_parameters`
    with truncate=true): dimension d turns r(d) = original_seq_len / wavelength times over the pretrained context;
    those above beta_fast turns keep their frequency (extrapolate), those below beta_slow are divided by factor
    (interpolate), with a linear ramp in d between the two dimension bounds (floored and ceiled, as transformers)."""
    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times (eq. 17 solved for d)
        return head_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(device=device, dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).to(device=device, dtype=torch.float)  # 1: extrapolate (unchanged), 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep


def inverse_frequencies(head_dim: int, theta: float, scaling: Optional[RopeScalingConfig] = None,
                        device: torch.device | None = None) -> Tuple[torch.Tensor, float]:
    """(inverse frequencies (Q/2,) fp32, multiplier of cos and sin) of model.rope_theta and model.rope_scaling."""
    if scaling is None:
        return default_inv_freq(head_dim, theta, device), 1.0
    if scaling.type == "llama3":
        return llama3_inv_freq(default_inv_freq(head_dim, theta, device), scaling.factor, scaling.low_freq_factor,
                               scaling.high_freq_factor, scaling.original_seq_len), 1.0
    inv_freq = yarn_inv_freq(head_dim, theta, scaling.factor, scaling.original_seq_len, scaling.beta_fast,
                             scaling.beta_slow, device)
    return inv_freq, yarn_attention_factor(scaling.factor, scaling.attention_factor)
