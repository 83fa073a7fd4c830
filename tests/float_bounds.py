"""Tolerances that float32 arithmetic promises on any CPU, derived from the magnitudes a computation
handles rather than from the error one machine's kernels happened to make.

Kernels differ between CPUs (AVX2 or AVX-512 lanes, vectorised or libm exp and log, MKL's or
oneDNN's blocking): each rounds differently, but none rounds by more than a few units in the last
place of the values it adds, subtracts or multiplies. A result that cancels large terms (a KL
divergence, a logit near zero) carries an error set by those terms, which can be many times its own
size.
"""
import math

#: float32's unit roundoff: one rounding moves a value by at most this fraction of itself
U32 = 2.0 ** -24


def kl_float32_tolerance(rows, scale=1.0, ulps=32):
    """A bound on the float32 error of ``scale * sum over rows of KL(p || q)``; ``rows`` holds the
    exact ``(p, q)`` probability lists of each row.

    float32 forms each log-probability as ``x - max - log(sum exp(x - max))``, every magnitude
    involved at most ``|log p|`` (plus ``exp`` and ``log``'s own error of an ulp or two), and the KL
    weighs ``log p - log q`` by ``p`` and sums: its error is a few ulps of
    ``sum p (|log p| + |log q| + 1)``, not of the KL, which cancels those terms. ``ulps`` (32)
    covers the roundings of log_softmax, exp, the subtraction, the product and the sums.
    """
    magnitude = sum(pi * (abs(math.log(pi)) + abs(math.log(qi)) + 1.0)
                    for p, q in rows for pi, qi in zip(p, q) if pi > 0)
    return ulps * U32 * abs(scale) * magnitude


def float32_reordering_tolerance(reference, ulps=256):
    """A bound on how far two float32 computations of the same network outputs, whose kernels add
    in different orders (fused or explicit attention, contiguous or strided inputs, other SIMD
    widths), may differ: ``ulps`` units of the tensor's largest magnitude. A reordered dot product
    of n terms moves by at most n ulps of its summands (Higham's gamma_n); the default, 256, covers
    a few such reductions of the tiny models' widths (32 to 64) between the two paths."""
    return ulps * U32 * float(reference.detach().abs().max())
