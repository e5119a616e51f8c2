"""Derivative modes beyond one reverse pass: forward mode (:mod:`.jvp`) and
second order (:mod:`.second_order`: forward-over-reverse for Hessian-vector
products, reverse-over-reverse for gradient penalties), each on the dense
path and the chunked path in linear memory.
"""

from .jvp import attention_jvp
from .second_order import SecondOrderCotangents, attention_backward_jvp, attention_double_backward

__all__ = ["attention_jvp", "attention_backward_jvp", "attention_double_backward", "SecondOrderCotangents"]
