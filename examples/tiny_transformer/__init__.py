"""The pieces of ``examples/train_tiny_transformer.py``, one idea per module.

- :mod:`.data`    the synthetic digit task (reverse or sort) and its held-out split
- :mod:`.layers`  embedding, layer norm, linear, GELU MLP: forward/backward pairs
- :mod:`.loss`    softmax cross-entropy masked to the target positions
- :mod:`.model`   the pre-norm decoder-only transformer around ``npattn``'s MHA
- :mod:`.adam`    Adam, global-norm clipping and the learning-rate schedule
- :mod:`.checks`  ``npattn.check_gradients`` on every hand-written layer

Every layer follows the JAX ``custom_vjp`` convention npattn uses:
``forward(*inputs) -> (y, residuals)`` and ``backward(dy, residuals) ->``
one gradient per input (None for integer inputs), so each pair can be handed
to :func:`npattn.check_gradients` unchanged.
"""
