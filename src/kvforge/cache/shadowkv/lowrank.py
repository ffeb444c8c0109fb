"""Low-rank pre-RoPE keys (ShadowKV): K [n, W] ~= A @ B with A [n, r] per token and
B [r, W] per sequence and layer (W = kv_heads x head_dim, all heads together).

B holds the top-r right singular vectors of K (orthonormal rows) and A = K @ B^T, so
A @ B is the best rank-r approximation of K (Eckart-Young). The paper stores U and S V^T;
we store U S and V^T, the same product and the same bytes, because new keys then project
onto the basis with a plain matmul (A_new = K_new @ B^T, no division by singular values),
which is how generated tokens are folded in (ShadowKV+).

The right singular vectors come from the eigenvectors of the Gram matrix K^T K [W, W]:
one GEMM over the n tokens plus a small symmetric eigensolve, much cheaper than an SVD of
the tall matrix at long context. The eigensolve runs in float64 on one thread (a W x W
problem is too small to share; with two threads on a busy machine MKL's solver was seen to
be far slower than on one; docs/benchmarks.md#measurements-behind-design-choices). At full
rank B is square and orthogonal, so A @ B reproduces K to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.cache.shadowkv.threads import cpu_threads
from kvforge.errors import require


@dataclass(frozen=True)
class KeySpectrum:
    """Right singular directions of keys [n, W], largest first: `directions` [W, W]
    (orthonormal rows) and `energy` [W], the cumulative share of ||K||_F^2 the top
    1..W of them retain (Eckart-Young), float64."""

    directions: torch.Tensor
    energy: torch.Tensor

    def basis(self, rank: int) -> torch.Tensor:
        """Orthonormal rows B [rank, W] spanning the top `rank` directions."""
        return self.directions[:rank].contiguous()


def key_spectrum(keys: torch.Tensor) -> KeySpectrum:
    k = keys.float()
    gram = (k.T @ k).double()
    with cpu_threads(1, gram.device):
        squares, vectors = torch.linalg.eigh(gram)  # ascending eigenvalues, orthonormal columns
    squares = squares.flip(0).clamp_min(0.0)
    total = squares.sum()
    energy = squares.cumsum(0) / total if bool(total > 0) else torch.ones_like(squares)
    return KeySpectrum(vectors.flip(-1).T.to(keys.dtype), energy)


def key_basis(keys: torch.Tensor, rank: int) -> torch.Tensor:
    """Orthonormal rows B [rank, W] spanning the top singular directions of keys [n, W]."""
    return key_spectrum(keys).basis(rank)


def rank_for_energy(energy: torch.Tensor, fraction: float) -> int:
    """Smallest rank whose cumulative energy [W] reaches `fraction` (1-based)."""
    require(0.0 < fraction <= 1.0, "fraction", fraction, "must be in (0, 1]")
    # A tolerance keeps exact-rank matrices at their rank despite rounding in the tail.
    index = int(torch.searchsorted(energy, torch.tensor(fraction - 1e-9, dtype=energy.dtype, device=energy.device)))
    return min(index + 1, energy.numel())


def project(keys: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Coefficients A [n, r] of keys [n, W] on the basis rows [r, W]."""
    return keys.to(basis.dtype) @ basis.T


def reconstruct(coefficients: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    return coefficients @ basis


def relative_error(keys: torch.Tensor, rank: int) -> float:
    """||K - A B||_F / ||K||_F of the rank-r approximation of keys [n, W]."""
    k = keys.float()
    basis = key_basis(k, rank)
    approx = reconstruct(project(k, basis), basis)
    return float(torch.linalg.norm(k - approx) / torch.linalg.norm(k).clamp_min(1e-30))
