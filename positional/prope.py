"""p-RoPE (Barbero et al. 2025, "Round and Round We Go! What makes Rotary Positional Encodings
useful?"): RoPE whose lowest-frequency pairs do not rotate.

Over a training context RoPE's slowest pairs turn by a small angle, so they serve as semantic
channels that still drift with distance, which the paper links to poor robustness at long
range. p-RoPE keeps the fraction p of the highest frequencies, theta_i for i < round(p D/2),
and sets the rest to 0: those pairs carry no position at all. p = 1 is RoPE, p = 0 is NoPE.
Every RoPE option (base, scaling, layout, rotate_values) applies to the frequencies kept.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from positional.rope import Rope


@dataclasses.dataclass(frozen=True)
class PRope(Rope):
    fraction: float = 0.75  # p: the fraction of frequencies (the highest) that rotate

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"p_rope fraction={self.fraction} must be in [0, 1]: the fraction of "
                             "frequencies that rotate")

    @property
    def theta(self) -> np.ndarray:
        theta = super().theta.copy()
        theta[round(self.fraction * theta.size):] = 0.0
        return theta
