"""npattn: framework-free masked attention, forward and hand-derived backward,
on NumPy, CuPy or any Python Array API namespace.

Public API
----------
attention_forward, attention_backward, attention
    Masked scaled dot-product attention (dense or chunked online-softmax).
check_gradients
    Central-difference gradient checker for any forward/backward pair.
diagnostics
    Entropy, peak, row sums, NaN/inf reports and heatmaps of attention weights.
"""

from .attention import (
    AttentionGrads,
    AttentionResiduals,
    ChunkedResiduals,
    DenseResiduals,
    attention,
    attention_backward,
    attention_forward,
)
from . import diagnostics
from .diagnostics import (
    attention_entropy,
    attention_peak,
    check_finite,
    plot_attention,
    row_sum_check,
    summarize,
)
from .gradient_check import GradcheckError, GradcheckResult, check_gradients

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_forward",
    "attention_backward",
    "AttentionGrads",
    "AttentionResiduals",
    "DenseResiduals",
    "ChunkedResiduals",
    "check_gradients",
    "GradcheckResult",
    "GradcheckError",
    "diagnostics",
    "attention_entropy",
    "attention_peak",
    "row_sum_check",
    "check_finite",
    "summarize",
    "plot_attention",
]
