"""npattn: framework-free masked attention, forward and hand-derived backward,
on NumPy, CuPy or any Python Array API namespace.

Public API
----------
attention_forward, attention_backward, attention
    Masked scaled dot-product attention (dense or chunked online-softmax).
check_gradients
    Central-difference gradient checker for any forward/backward pair.
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
]
