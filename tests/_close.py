"""Float comparisons relative to magnitude, shared by the oracle tests.

``torch.testing.assert_close`` checks each element against ``atol + rtol * |expected|``: an
element that is small but summed from large terms (a gradient entry next to entries near 780)
then fails on float32 rounding alone, depending on how the batch was split. Here the tolerance
scales with the largest magnitude in the expected tensor, so the check asks what data
parallelism promises (the same result up to summation order), on any seed.
"""

from __future__ import annotations

import torch

__all__ = ["RTOL", "assert_close_rel"]

# float32 keeps about 7 digits; reordered sums of a few hundred terms lose one or two.
RTOL = 1e-5


def assert_close_rel(
    actual: torch.Tensor, expected: torch.Tensor, *, rtol: float = RTOL, msg: str = ""
) -> None:
    """Assert ``actual`` equals ``expected`` (shape, dtype, values) within ``rtol`` of the
    expected tensor's largest magnitude (at least ``rtol`` in absolute terms)."""
    assert actual.shape == expected.shape, f"{msg}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{msg}: dtype {actual.dtype} != {expected.dtype}"
    if not expected.is_floating_point() and not expected.is_complex():
        assert torch.equal(actual, expected), f"{msg}: {actual} != {expected}"
        return
    if expected.numel() == 0:
        return
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    scale = max(1.0, e.abs().max().item())
    diff = (a - e).abs().max().item()
    assert diff <= rtol * scale, (
        f"{msg}: differs by {diff:.3g}, more than {rtol:g} of the largest magnitude {scale:.3g}"
    )
