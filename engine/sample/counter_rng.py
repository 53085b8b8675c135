"""Counter-based random sampling: a seeded draw is a pure function of (seed, position, probs).

Sampling uses the exponential race: with E_v ~ Exp(1) independent, argmax_v p_v / E_v is
distributed as Categorical(p). For seeded rows E_v comes from a stateless hash of
(seed, output position, token id) instead of a generator, so the drawn token does not depend on
which other requests share the batch, on the row, or on which engine samples which position
(a prefill engine drawing position 0 and a decode engine drawing 1.. agree with one engine).
"""

from __future__ import annotations

import torch

# splitmix64 constants (Steele, Lea & Flood, 2014), as int64 two's-complement values.
_MASK64 = (1 << 64) - 1


def _as_int64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN_GAMMA = _as_int64(0x9E3779B97F4A7C15)
_MIX_1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX_2 = _as_int64(0x94D049BB133111EB)
# Rows per chunk are chosen so one int64 intermediate stays near 32 MiB.
_CHUNK_ELEMENTS = 1 << 22


def _shift_right_logical(z: torch.Tensor, bits: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic (copies the sign bit); mask the copies away.
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser on int64 tensors (multiplication wraps mod 2**64)."""
    z = z ^ _shift_right_logical(z, 30)
    z = z * _MIX_1
    z = z ^ _shift_right_logical(z, 27)
    z = z * _MIX_2
    return z ^ _shift_right_logical(z, 31)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[R] int64: one key per (seed, output position) pair."""
    return mix64(mix64(seeds + _GOLDEN_GAMMA) ^ positions)


def hashed_uniform(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] float64 in (0, 1): element (r, v) = splitmix64 output v of stream keys[r]."""
    counters = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=keys.device)
    bits = mix64(keys.unsqueeze(1) + counters * _GOLDEN_GAMMA)
    # 52 random bits + 0.5 is exact in float64 and never 0 or 1.
    top52 = _shift_right_logical(bits, 12).to(torch.float64)
    return (top52 + 0.5) * (2.0**-52)


def seeded_exponential_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] float64 Exp(1) samples, strictly positive."""
    return hashed_uniform(keys, vocab_size).log_().neg_()


def sample_seeded(
    probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """[R] int64 tokens drawn from `probs` [R, V] with hashed noise, chunked over rows.

    float64 throughout, so a one-ulp wobble of a vectorised log (which can depend on where an
    element lands in a SIMD lane) is far too small to change which token wins.
    """
    num_rows, vocab_size = probs.shape
    keys = row_keys(seeds, positions)
    out = torch.empty(num_rows, dtype=torch.int64, device=probs.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, vocab_size))
    for start in range(0, num_rows, step):
        end = min(start + step, num_rows)
        noise = seeded_exponential_noise(keys[start:end], vocab_size)
        race = probs[start:end].to(torch.float64) / noise
        out[start:end] = race.argmax(dim=-1)
    return out


def sample_unseeded(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[R] int64 tokens drawn from `probs` [R, V] with noise from `generator`."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    # exponential_ can return 0 in float32; p / 0 would turn zero-probability tokens into NaN.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)
