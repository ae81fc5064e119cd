"""Error bounds for fp32 computations checked against a float64 reference.

A fixed tolerance such as 1e-5 holds on one machine and fails on another: the summation order of a long
reduction depends on the CPU's vector width (numpy under the Triton interpreter, BLAS, our C++ kernels).
These bounds follow the standard worst-case analysis instead (Higham, "Accuracy and Stability of Numerical
Algorithms", ch. 3): a sum of n fp32 products in any order is off by at most gamma(n) times the sum of their
magnitudes. They scale with the values and the reduction length, so they hold in every summation order,
and they stay orders of magnitude below the error of a real bug (a missing rescaling, a wrong index).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Unit roundoff of fp32 (round to nearest).
U32 = 2.0**-24


def gamma(n: int) -> float:
    """Relative error bound of an n-term fp32 sum or dot product, in any order."""
    return n * U32 / (1 - n * U32)


def matmul_error(a: Tensor, b: Tensor) -> Tensor:
    """Bound on |fl(a @ b) - a @ b| for fp32 a [.., K] and b [K, ..]: gamma(K) * |a| @ |b|, in float64."""
    return gamma(a.shape[-1]) * (a.double().abs() @ b.double().abs())


def softmax_average_error(logits: Tensor, logit_error: Tensor, values: Tensor) -> Tensor:
    """Bound on the fp32 error of softmax(logits) @ values, online or in one pass.

    logits [..., n] are exact (float64; -inf for masked keys), logit_error [..., n] bounds how far the fp32
    logits are from them, values [n, C]. A logit off by e makes its weight off by a factor exp(e); the weight
    is also off by the rounding of subtracting the running max and of exp, and by the rescaling of what was
    summed so far each time the max moves (each at most a few ulps of |logit - max| or of the range).
    With eps_i those relative weight errors and w the exact weights, the normalized average is off by at most
    (sum w_i eps_i |v_i| + sum w_i eps_i * |out|) / (1 - sum w_i eps_i), plus the rounding of its two
    n-term sums and the division. Returns [..., C] in float64.
    """
    n = logits.shape[-1]
    visible = logits.isfinite()
    weights = logits.softmax(dim=-1)
    peak = logits.amax(dim=-1, keepdim=True)
    spread = torch.where(visible, peak - logits, 0.0)
    worst = torch.where(visible, logit_error, 0.0).amax(dim=-1, keepdim=True)
    # The max is itself computed with an error of at most `worst`; rounding terms of 8 ulps per step cover
    # the subtraction, exp (correctly rounded or a polynomial within a few ulps) and the rescalings.
    rounding = 8 * U32 * (spread + spread.amax(dim=-1, keepdim=True) + n)
    eps = torch.expm1(torch.where(visible, logit_error, 0.0) + worst + rounding)
    drift = (weights * eps).sum(dim=-1, keepdim=True)
    magnitude = weights @ values.abs()
    out = (weights @ values).abs()
    summed = 2 * gamma(n + 1) * magnitude
    return ((weights * eps) @ values.abs() + drift * out + summed) / (1 - drift - 2 * gamma(n + 1))


def dot_logit_error(queries: Tensor, keys: Tensor, scale: float) -> Tensor:
    """Bound on the error of fp32 logits scale * (queries @ keys.T): the dot, then the scaling."""
    exact = scale * (queries.double() @ keys.double().T)
    return scale * matmul_error(queries, keys.T) + U32 * exact.abs()


def assert_within(actual: Tensor, expected: Tensor, bound: Tensor) -> None:
    """Every element of actual within bound of the float64 expected; the message names the worst one."""
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), "non-finite output"
    err = (actual.double() - expected).abs()
    outside = err > bound
    if outside.any():
        worst = int((err / bound).argmax())
        raise AssertionError(
            f"{int(outside.sum())} of {err.numel()} elements outside the error bound; worst at flat index "
            f"{worst}: |error| {err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g}"
        )


def activation_codes_error(x: Tensor, w_abs: Tensor) -> Tensor:
    """Bound on what the CPU integer-weight kernels' 16-bit codes of x add to x @ W.T: each value of a row
    is off by at most half a code step (row amax / 32767, rounded, so 0.505 of one), times sum |W| of the
    output's weights. x [T, K], w_abs |W| [N, K] -> [T, N], float64."""
    step = x.double().abs().amax(dim=-1, keepdim=True) / 32767
    return 0.505 * step * w_abs.double().sum(dim=-1)
