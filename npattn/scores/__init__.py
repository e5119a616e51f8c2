"""The score pipeline: each variant of attention as one small unit (its score
transform, its derivative, what it knows about whole tiles), written once and
called by every path. See :mod:`npattn.scores.pipeline` for the order.

Modules: ``tiles`` (tile selection and positions), ``softcap`` (step 2),
``alibi`` (step 3's position bias, and :func:`alibi_slopes`), ``mods``
(step 4, user score modifications, and the user mask modification: the
public extension point), ``pipeline`` (steps 2-4 together, the bias,
parameter gradients), ``visibility`` (step 5: masks, causal/window, lengths,
segment ids, mask modifications, tile classification), ``block_mask`` (a
mask modification classified once per block), ``library`` (the shipped
score modifications, written through ``mods``' interface), ``sinks``
(step 6).
"""

from .alibi import alibi_slopes

__all__ = ["alibi_slopes"]
