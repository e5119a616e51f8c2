"""The key/value cache for incremental (autoregressive) decoding.

Decoding a sequence one token (or a few tokens) at a time recomputes nothing:
each call of :func:`npattn.mha_forward` with ``cache=`` projects only the new
positions to keys and values, appends them to the cache, and lets the new
queries attend over everything cached so far with ``align="bottom_right"``
(query ``i`` of ``t`` new ones sits at position ``L + i``, ``L`` the length
before the call). With ``causal=True`` this gives the same outputs as one
causal forward over the whole sequence, with every variant of the score
pipeline: softcap and sinks need no state, ALiBi reads the same positions
(bottom-right), and segment ids (packed documents) are remembered here.

Segment ids: a cache either holds no ids, or one id per cached position,
``(B, L)`` int64, decided by its first append (``mha_forward(...,
q_segment_ids=ids, cache=cache)`` appends the new tokens' ids as key ids
too). Appending with ids to a cache without them, or without ids to a cache
with them, is a ``ValueError``: the mask of the cached keys would be unknown.

Two storage modes::

    growing        max_length=None   keys = concat(keys, k_new)       (B, K, L + t, H)
    preallocated   max_length=M      buffer[:, :, L:L + t] = k_new    (B, K, M, H), views [:L + t]

The preallocated buffer is allocated once; positions below the current length
are never written again (``reset`` allocates a fresh buffer), so views handed
out earlier keep their values.
"""

from __future__ import annotations

from typing import Any

from .mha_params import layer_dims
from .namespace import array_device, check_float_dtype, check_namespace, compute_dtype, resolve_namespace
from .options import check_int

__all__ = ["KVCache", "default_float_dtype"]


def default_float_dtype(xp: Any, device: Any = None) -> Any:
    """The namespace's default real floating dtype (``float64`` for NumPy,
    ``float32`` for PyTorch), from ``__array_namespace_info__`` when present.

    >>> import array_api_compat.numpy as xp
    >>> default_float_dtype(xp)
    dtype('float64')
    """
    info = getattr(xp, "__array_namespace_info__", None)
    if info is None:
        return xp.float64
    return info().default_dtypes(device=device)["real floating"]


class KVCache:
    r"""Keys and values of the positions decoded so far, for incremental
    self-attention decoding with :func:`npattn.mha_forward` (forward only).

    The cache holds the *projected, head-split* keys and values
    ``(B, K, L, H)``: B batch, K key/value heads, L positions cached so far,
    H head dim. Pass it as ``mha_forward(params, x_new, cache=cache,
    causal=True)``; each call appends the ``t`` new positions of ``x_new``
    ``(B, t, E)`` and attends with ``align="bottom_right"``.

    Parameters
    ----------
    batch_size : int
        B; every call must feed this many sequences.
    num_kv_heads : int
        K, the layer's key/value heads.
    head_dim : int
        H = embed_dim // num_heads.
    max_length : int, optional
        None (default): the cache grows by concatenation, without bound.
        An int: one ``(B, K, max_length, H)`` buffer is allocated up front and
        appending past it is a ``ValueError``.
    dtype : dtype, optional
        Dtype of the stored keys and values; the layer's compute dtype
        (float32 for half-precision params). Defaults to the namespace's
        default float dtype.
    device : device, optional
        Where the buffers live (default: the namespace's default device).
    xp : namespace, optional
        Array API namespace (default: NumPy through ``array_api_compat``).

    Attributes
    ----------
    length : int
        L, positions cached so far.
    keys, values : arrays, (B, K, L, H)
        The cached keys and values (views of the buffer when preallocated).
    segment_ids : int64 array (B, L), or None
        The cached positions' segment ids, when the cache was filled with
        them (see the module docstring).

    See Also
    --------
    KVCache.for_mha : a cache sized from a layer's params.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.kv_cache import KVCache
    >>> cache = KVCache(2, 1, 4, max_length=5)
    >>> k = v = np.ones((2, 1, 3, 4))
    >>> keys, values = cache.append(k, v)
    >>> keys.shape, cache.length, cache.max_length
    ((2, 1, 3, 4), 3, 5)
    >>> cache.append(k, v)
    Traceback (most recent call last):
    ...
    ValueError: cache is full: max_length=5 holds 3 positions and cannot take 3 more
    """

    def __init__(self, batch_size, num_kv_heads, head_dim, *, max_length=None, dtype=None, device=None, xp=None):
        if xp is None:
            import array_api_compat.numpy as xp
        self._batch_size = check_int("batch_size", batch_size, minimum=1)
        self._num_kv_heads = check_int("num_kv_heads", num_kv_heads, minimum=1)
        self._head_dim = check_int("head_dim", head_dim, minimum=1)
        self._max_length = None if max_length is None else check_int("max_length", max_length, minimum=1)
        self._xp = check_namespace(xp)
        self._dtype = default_float_dtype(xp, device) if dtype is None else dtype
        check_float_dtype(xp, "dtype", self._dtype)
        self._device = device
        self.reset()

    @classmethod
    def for_mha(cls, params, batch_size, /, *, num_heads, num_kv_heads=None, max_length=None):
        """A cache for the layer ``params`` (as made by :func:`npattn.mha_init`).

        Reads K and H from the params, and takes their namespace, device and
        compute dtype (float32 for half-precision params).

        >>> from npattn.kv_cache import KVCache
        >>> from npattn.mha import mha_init
        >>> params = mha_init(8, 4, num_kv_heads=2)
        >>> cache = KVCache.for_mha(params, 3, num_heads=4, max_length=16)
        >>> cache.batch_size, cache.num_kv_heads, cache.head_dim
        (3, 2, 2)
        """
        dims = layer_dims(params, num_heads=num_heads, num_kv_heads=num_kv_heads)
        weight = params["k_weight"]
        xp = resolve_namespace({"params['k_weight']": weight})
        return cls(
            batch_size,
            dims.num_kv_heads,
            dims.head_dim,
            max_length=max_length,
            dtype=compute_dtype(xp, weight.dtype),
            device=array_device(weight),
            xp=xp,
        )

    # --- read-only state ---------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def num_kv_heads(self) -> int:
        return self._num_kv_heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def max_length(self) -> int | None:
        """The preallocated capacity, or None for a growing cache."""
        return self._max_length

    @property
    def length(self) -> int:
        """Positions cached so far."""
        return self._length

    @property
    def dtype(self) -> Any:
        return self._dtype

    @property
    def xp(self) -> Any:
        return self._xp

    @property
    def keys(self) -> Any:
        """Cached keys, ``(B, K, L, H)``."""
        return self._keys[:, :, : self._length, :]  # (B, K, L, H)

    @property
    def values(self) -> Any:
        """Cached values, ``(B, K, L, H)``."""
        return self._values[:, :, : self._length, :]  # (B, K, L, H)

    @property
    def segment_ids(self) -> Any | None:
        """Cached positions' segment ids, int64 ``(B, L)``, or None for a
        cache filled without them."""
        return None if self._segment_ids is None else self._segment_ids[:, : self._length]  # (B, L)

    def __repr__(self) -> str:
        capacity = "growing" if self._max_length is None else f"max_length={self._max_length}"
        return (
            f"KVCache(batch_size={self._batch_size}, num_kv_heads={self._num_kv_heads}, "
            f"head_dim={self._head_dim}, length={self._length}, {capacity}, dtype={self._dtype})"
        )

    # --- updates -----------------------------------------------------------
    def reset(self) -> None:
        """Forget every cached position (a preallocated cache gets a fresh
        buffer, so arrays handed out before keep their values)."""
        xp = self._xp
        capacity = 0 if self._max_length is None else self._max_length
        shape = (self._batch_size, self._num_kv_heads, capacity, self._head_dim)
        self._keys = xp.zeros(shape, dtype=self._dtype, device=self._device)  # (B, K, M, H)
        self._values = xp.zeros(shape, dtype=self._dtype, device=self._device)  # (B, K, M, H)
        if self._device is None:
            self._device = array_device(self._keys)
        self._dtype = self._keys.dtype  # normalized (np.float32 -> dtype('float32'))
        self._segment_ids: Any = None  # (B, M) int64 once the first append brings ids
        self._length = 0

    def check_new(self, batch_size: int, new_positions: int, *, what: str = "x") -> None:
        """Raise ``ValueError`` unless ``new_positions`` more positions of a
        batch of ``batch_size`` fit: the batch must be the cache's and a
        preallocated cache must have room."""
        if batch_size != self._batch_size:
            raise ValueError(
                f"cache was made for batch_size={self._batch_size}, but {what} has batch size {batch_size}"
            )
        if self._max_length is not None and self._length + new_positions > self._max_length:
            raise ValueError(
                f"cache is full: max_length={self._max_length} holds {self._length} positions "
                f"and cannot take {new_positions} more"
            )

    def _check_segment_ids(self, given: bool, *, what: str = "segment_ids") -> None:
        """Raise ``ValueError`` unless an append with (``given``) or without
        segment ids fits what the cache holds: an empty cache takes either,
        a filled one only what it was filled with."""
        if self._length == 0 or given == (self._segment_ids is not None):
            return
        if given:
            raise ValueError(
                f"{what} given, but the cache holds {self._length} positions without segment ids: "
                "pass ids from the first token on (cache.reset() to start over)"
            )
        raise ValueError(
            f"the cache holds segment ids for its {self._length} positions: pass {what} (B, t) "
            "for the new positions too"
        )

    def _stage_segment_ids(self, ids: Any, t: int) -> tuple[Any, Any]:
        """``(ids of all L + t positions (B, L + t), the id buffer to commit)``
        for the new positions' ``ids`` (B, t), or ``(None, None)``."""
        self._check_segment_ids(ids is not None)
        if ids is None:
            return None, None
        xp, B, L = self._xp, self._batch_size, self._length
        if not hasattr(ids, "shape") or not hasattr(ids, "dtype"):
            raise TypeError(
                f"segment_ids must be an integer array of shape (B, t) = ({B}, {t}), got {type(ids).__name__}"
            )
        resolve_namespace({"cache": self._keys, "segment_ids": ids})
        if not xp.isdtype(ids.dtype, "integral"):
            raise TypeError(f"segment_ids must have an integer dtype, got {ids.dtype}")
        if tuple(ids.shape) != (B, t):
            raise ValueError(f"segment_ids must have shape (B, t) = ({B}, {t}), got {tuple(ids.shape)}")
        ids = xp.astype(ids, xp.int64)  # (B, t), a copy: the caller's array is never stored
        if self._max_length is None:
            old = self._segment_ids  # (B, L), or None when L = 0
            buffer = ids if old is None else xp.concat((old, ids), axis=1)  # (B, L + t)
            return buffer, buffer
        buffer = self._segment_ids
        if buffer is None:  # the first append with ids allocates (B, M) once
            buffer = xp.zeros((B, self._max_length), dtype=xp.int64, device=self._device)
        buffer[:, L : L + t] = ids  # positions >= L belong to no array handed out
        return buffer[:, : L + t], buffer

    def _stage(self, k: Any, v: Any, segment_ids: Any = None) -> tuple[Any, Any, Any, tuple]:
        """Validate ``k``, ``v`` ``(B, K, t, H)`` and the new positions'
        ``segment_ids`` (B, t) or None, and return ``(keys, values, ids,
        state)``: the cache contents (and ids, or None) with the new positions
        appended, without committing them yet (``_commit(state)`` does)."""
        xp = self._xp
        for name, a in (("k", k), ("v", v)):
            if a is None:
                raise TypeError(f"{name} must be an array of shape (B, K, t, H), got None")
        resolve_namespace({"cache": self._keys, "k": k, "v": v})
        for name, a in (("k", k), ("v", v)):
            if a.ndim != 4:
                raise ValueError(f"{name} must have shape (B, K, t, H), got {tuple(a.shape)}")
            if a.dtype != self._dtype:
                raise TypeError(f"{name} has dtype {a.dtype} but the cache stores {self._dtype}")
        if tuple(k.shape) != tuple(v.shape):
            raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        B, K, t, H = k.shape
        self.check_new(B, t, what="k")
        if (self._num_kv_heads, self._head_dim) != (K, H):
            raise ValueError(
                f"cache holds num_kv_heads={self._num_kv_heads}, head_dim={self._head_dim}; "
                f"got k with {K} heads of dim {H}"
            )
        ids, id_buffer = self._stage_segment_ids(segment_ids, t)  # (B, L + t) or None
        L = self._length
        if self._max_length is None:
            keys = xp.concat((self._keys, k), axis=2)  # (B, K, L + t, H)
            values = xp.concat((self._values, v), axis=2)  # (B, K, L + t, H)
            return keys, values, ids, (keys, values, id_buffer, L + t)
        # Positions >= L belong to no array handed out, so writing them is safe
        # even if the caller's forward then fails (the length is not advanced).
        self._keys[:, :, L : L + t, :] = k  # (B, K, t, H) into (B, K, M, H)
        self._values[:, :, L : L + t, :] = v
        keys = self._keys[:, :, : L + t, :]  # (B, K, L + t, H)
        values = self._values[:, :, : L + t, :]  # (B, K, L + t, H)
        return keys, values, ids, (self._keys, self._values, id_buffer, L + t)

    def _commit(self, state: tuple) -> None:
        self._keys, self._values, self._segment_ids, self._length = state

    def append(self, k, v, /, *, segment_ids=None) -> tuple[Any, Any]:
        """Append ``t`` positions and return all cached ``(keys, values)``.

        Parameters
        ----------
        k, v : arrays, (B, K, t, H)
            New keys and values in the cache's dtype, namespace and device.
        segment_ids : int array (B, t), optional
            The new positions' segment ids; then :attr:`segment_ids` holds
            all ``(B, L + t)``. Every append of a cache brings ids, or none.

        Returns
        -------
        keys, values : arrays, (B, K, L + t, H)

        Raises
        ------
        ValueError
            Another batch size, heads or head dim, or a preallocated cache
            without room for ``t`` more positions.
            Segment ids of another shape, or given to a cache filled without
            them (or missing from one filled with them).
        TypeError
            Another dtype or array library, non-integer segment ids.
        """
        keys, values, _, state = self._stage(k, v, segment_ids)
        self._commit(state)
        return keys, values
