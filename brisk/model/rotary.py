"""Rotary position embeddings with the scaling types found in HF configs.

The model looks up one `[num_tokens, head_dim]` cos/sin pair per forward (by position) and every
layer reuses it. Tables are built once at start-up for `max_positions` positions, so the hot path
is a single gather. Layout is HF's "rotate half" (NeoX) convention; GGUF Q/K weights are permuted
back to it by the loader.
"""

from __future__ import annotations

import math

import torch

from brisk.config import RopeScaling


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    # float32 exponents, as HF computes them, so the angles are bit-identical.
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim/2]


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling, max_pos: int) -> torch.Tensor:
    """Llama 3.1: leave high frequencies, divide low ones by `factor`, blend in between."""
    old_len = s.original_max_position_embeddings or max_pos
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(base: float, dim: int, s: RopeScaling, max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): interpolate low frequencies, keep high ones, ramp between."""
    orig = s.original_max_position_embeddings or max_pos
    if s.attention_factor is not None:
        attn = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attn = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attn = _yarn_mscale(s.factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp  # 1 where the original (extrapolated) frequency is kept
    return interpolation * (1 - keep) + extrapolation * keep, attn


def _longrope_inv_freq(base: float, dim: int, s: RopeScaling, max_positions: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): each frequency divided by a learned factor, the short list within the
    original window, the long one beyond it; cos/sin scaled by `attention_factor`.

    Which list is chosen once, by the positions this instance serves (`max_positions`), as llama.cpp
    chooses by its context size: HF switches per forward call once a sequence passes the original
    window, so there a token's rotation depends on how its sequence was batched. A run whose context
    fits the original window gets HF's short-factor rotation exactly; one beyond it rotates every
    position with the long factors (HF's result for a whole sequence longer than the window)."""
    orig = s.original_max_position_embeddings or max_positions
    attn = s.attention_factor
    if attn is None:
        attn = 1.0 if s.factor <= 1.0 else math.sqrt(1 + math.log(s.factor) / math.log(orig))
    factors = torch.tensor(s.long_factor if max_positions > orig else s.short_factor, dtype=torch.float32)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (factors * base ** exponents), attn  # HF's float32 order of operations


def _dynamic_angles(base: float, dim: int, s: RopeScaling, max_pos: int, n: int) -> torch.Tensor:
    """Dynamic NTK, per position.

    HF recomputes the base from the current sequence length once it exceeds the trained window.
    With a KV cache a token's key keeps the rotation it got when it was computed, so computing each
    position with the base for "length = position + 1" reproduces HF's incremental decoding exactly,
    and equals plain rotary inside the trained window. float32 like HF, for identical angles.
    """
    pos = torch.arange(n, dtype=torch.float32)
    seq_len = torch.clamp(torch.arange(1, n + 1, dtype=torch.float64), min=max_pos)  # [n]
    scaled_base = base * ((s.factor * seq_len / max_pos) - (s.factor - 1)) ** (dim / (dim - 2))  # [n]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim/2]
    inv = 1.0 / (scaled_base.float()[:, None] ** exponents[None, :])  # [n, dim/2]
    return pos[:, None] * inv


def rope_tables(
    head_dim: int, base: float, scaling: RopeScaling, max_position_embeddings: int, max_positions: int,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each `[max_positions, head_dim]` in float32, attention factor folded in.

    Partial rotary (`rotary_dim` < head_dim): the frequencies of `rotary_dim` dims, then angle 0
    (cos 1, sin 0) for the pairs that do not rotate; the q / k rows are laid out so that those are
    the pairs the rotate-half kernels pair up (`partial_rotary_order`)."""
    dim = rotary_dim or head_dim  # the scalings see the rotated dims only, as HF's do
    attn_factor = 1.0
    if scaling.rope_type == "dynamic":
        angles = _dynamic_angles(base, dim, scaling, max_position_embeddings, max_positions)
    else:
        inv_freq = _default_inv_freq(base, dim)
        if scaling.rope_type == "linear":
            inv_freq = inv_freq / scaling.factor
        elif scaling.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling, max_position_embeddings)
        elif scaling.rope_type == "yarn":
            inv_freq, attn_factor = _yarn_inv_freq(base, dim, scaling, max_position_embeddings)
        elif scaling.rope_type == "longrope":
            inv_freq, attn_factor = _longrope_inv_freq(base, dim, scaling, max_positions)
        if scaling.freq_factors:  # llama.cpp's rope_freqs: theta_i / factor_i
            inv_freq = inv_freq / torch.tensor(scaling.freq_factors, dtype=inv_freq.dtype)
        # HF computes inv_freq in float32 before the outer product; match it for identical logits.
        inv32 = inv_freq.to(torch.float32)
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv32[None, :]
    angles = angles.to(torch.float32)  # [max_positions, dim / 2]
    cos, sin = angles.cos() * attn_factor, angles.sin() * attn_factor
    if dim < head_dim:  # pass-through pairs: cos 1, sin 0 (the attention factor scales rotated dims only)
        rest = (angles.shape[0], (head_dim - dim) // 2)
        cos, sin = torch.cat([cos, cos.new_ones(rest)], dim=1), torch.cat([sin, sin.new_zeros(rest)], dim=1)
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)  # [max_positions, head_dim] each


def partial_rotary_order(head_dim: int, rotary_dim: int) -> list[int] | None:
    """The order of a head's dims that makes HF's partial rotary a full-width rotate-half.

    HF rotates the first `rotary_dim` dims as halves (pairs i, i + rotary_dim / 2) and passes the
    rest through; brisk's kernels rotate pairs (j, j + head_dim / 2). Putting old dim
    rotary_dim / 2 + i at j = head_dim / 2 + i, and the pass-through dims in the pairs left over
    (which get angle 0), makes the two the same; q and k permuted alike keep every q.k. None
    when every dim rotates."""
    if rotary_dim >= head_dim:
        return None
    half, rot_half = head_dim // 2, rotary_dim // 2
    passing = list(range(rotary_dim, head_dim))
    first, second = passing[: half - rot_half], passing[half - rot_half:]
    return list(range(rot_half)) + first + list(range(rot_half, rotary_dim)) + second


def permute_heads(rows: torch.Tensor, order: list[int], head_dim: int) -> torch.Tensor:
    """Rows [heads * head_dim, ...] (a projection's weight, bias, or a GGUF tensor's block rows)
    with each head's dims in `order` (a copy)."""
    index = (torch.arange(rows.shape[0] // head_dim)[:, None] * head_dim + torch.tensor(order)[None, :]).flatten()
    return rows.index_select(0, index)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[num_tokens, num_heads, head_dim]` by per-token cos/sin `[num_tokens, 1, head_dim]`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
