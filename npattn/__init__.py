"""npattn: framework-free masked attention, forward and hand-derived backward,
on NumPy, CuPy or any Python Array API namespace.

Public API
----------
attention_forward, attention_backward, attention
    Masked scaled dot-product attention (dense or chunked online-softmax).
mha_init, mha_forward, mha_backward, MultiheadAttention, KVCache
    Multi-head attention layer with hand-derived backward, KV-cache decoding
    and PyTorch weight/mask interop.
merge_partials, merge_partials_backward
    Combine attention over disjoint key sets through lse (split-KV, ring attention).
npattn.distributed (extra "mpi"; import it explicitly)
    ring_attention_forward, ring_attention_backward: exact sequence-parallel attention over MPI.
ScoreMod, block_mask, softcap_mod, alibi_mod, relative_position_bias, head_temperature
    User score and mask modifications with hand-written derivatives (FlexAttention's idea).
check_gradients
    Central-difference gradient checker for any forward/backward pair.
diagnostics
    Entropy, peak, row sums, NaN/inf reports and heatmaps of attention weights.
"""

from . import diagnostics
from .attention import (
    AttentionGrads,
    AttentionResiduals,
    ChunkedResiduals,
    DenseResiduals,
    attention,
    attention_backward,
    attention_forward,
)
from .diagnostics import (
    attention_entropy,
    attention_peak,
    check_finite,
    plot_attention,
    row_sum_check,
    summarize,
)
from .gradient_check import GradcheckError, GradcheckResult, check_gradients, check_jvp, check_score_mod
from .interop import mha_masks_from_torch, mha_params_from_torch, mha_params_to_torch
from .kv_cache import KVCache
from .merge import MergeResiduals, merge_partials, merge_partials_backward
from .mha import MHAGrads, MHAResiduals, MultiheadAttention, mha_backward, mha_forward, mha_init
from .modes import SecondOrderCotangents, attention_backward_jvp, attention_double_backward, attention_jvp
from .scores import alibi_slopes
from .scores.block_mask import BlockMask, block_mask
from .scores.library import alibi_mod, head_temperature, relative_position_bias, softcap_mod, t5_buckets
from .scores.mods import ScoreMod, TileIndex

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_forward",
    "attention_backward",
    "attention_jvp",
    "attention_backward_jvp",
    "attention_double_backward",
    "SecondOrderCotangents",
    "alibi_slopes",
    "ScoreMod",
    "TileIndex",
    "block_mask",
    "BlockMask",
    "softcap_mod",
    "alibi_mod",
    "relative_position_bias",
    "t5_buckets",
    "head_temperature",
    "AttentionGrads",
    "AttentionResiduals",
    "DenseResiduals",
    "ChunkedResiduals",
    "check_gradients",
    "check_jvp",
    "check_score_mod",
    "GradcheckResult",
    "GradcheckError",
    "mha_init",
    "mha_forward",
    "mha_backward",
    "MHAGrads",
    "MHAResiduals",
    "MultiheadAttention",
    "KVCache",
    "mha_params_from_torch",
    "mha_params_to_torch",
    "mha_masks_from_torch",
    "merge_partials",
    "merge_partials_backward",
    "MergeResiduals",
    "diagnostics",
    "attention_entropy",
    "attention_peak",
    "row_sum_check",
    "check_finite",
    "summarize",
    "plot_attention",
]
