r"""The synthetic task: copy a string of digits reversed (or sorted).

One example of length ``L`` is the token sequence::

    d_1 d_2 ... d_L  |  o_1 o_2 ... o_L          o = reversed(d)  (or sorted(d))

with digits ``0..9`` and the separator ``| = 10`` (vocabulary V = 11). The
model reads ``ids = seq[:-1]`` (T = 2L positions) and predicts
``targets = seq[1:]``; only the L positions that predict an output digit
count (``mask``), since the input digits are random and cannot be predicted.

Held-out split: the validation digit strings are drawn once from their own
seed, and any training string equal to one of them is redrawn, so validation
accuracy is measured on sequences the model never trained on.
"""

from __future__ import annotations

import numpy as np

SEP = 10  # the separator token "|"
VOCAB_SIZE = 11  # digits 0..9 and SEP
TASKS = ("reverse", "sort")


def token_label(token: int) -> str:
    """``"0".."9"`` for digits, ``"|"`` for the separator."""
    return "|" if token == SEP else str(token)


def targets_of(digits: np.ndarray, task: str) -> np.ndarray:
    """The output digits: ``(B, L) -> (B, L)``, reversed or sorted along each row."""
    if task == "reverse":
        return digits[:, ::-1]  # (B, L)
    if task == "sort":
        return np.sort(digits, axis=1)  # (B, L)
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")


def encode(digits: np.ndarray, task: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, targets, mask)`` for next-token prediction on ``digits | output``.

    Returns
    -------
    ids : int array, (B, 2L)      ``seq[:, :-1]``, the model's input
    targets : int array, (B, 2L)  ``seq[:, 1:]``, the next token at each position
    mask : bool array, (B, 2L)    True at positions ``L .. 2L-1`` (they predict ``o_1 .. o_L``)
    """
    B, L = digits.shape
    sep = np.full((B, 1), SEP, dtype=digits.dtype)  # (B, 1)
    seq = np.concatenate([digits, sep, targets_of(digits, task)], axis=1)  # (B, 2L+1)
    ids, targets = seq[:, :-1], seq[:, 1:]  # (B, 2L) each
    mask = np.broadcast_to(np.arange(2 * L) >= L, (B, 2 * L))  # (B, 2L)
    return ids, targets, mask


def _keys(digits: np.ndarray) -> np.ndarray:
    """Each row of digits as one integer (its decimal value), ``(B, L) -> (B,)``."""
    return digits.astype(np.int64) @ (10 ** np.arange(digits.shape[1], dtype=np.int64))  # (B,)


class DigitTask:
    """Random batches for training, and a fixed held-out validation set.

    Parameters
    ----------
    length : int
        L, digits per example (T = 2L positions).
    task : {"reverse", "sort"}
    num_val : int
        Size of the held-out set.
    seed : int
        Seeds the validation set (``seed``) and the training stream (``seed + 1``).
    """

    def __init__(self, length: int, task: str = "reverse", *, num_val: int = 1000, seed: int = 0):
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        self.length, self.task = length, task
        self.val_digits = np.random.default_rng(seed).integers(0, 10, size=(num_val, length))  # (Bv, L)
        self._val_keys = np.unique(_keys(self.val_digits))  # (<= Bv,)
        self._rng = np.random.default_rng(seed + 1)

    @property
    def seq_len(self) -> int:
        """T = 2L, the model's context length."""
        return 2 * self.length

    def train_batch(self, batch_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``encode`` of fresh random digit strings, none of them in the validation set."""
        digits = self._rng.integers(0, 10, size=(batch_size, self.length))  # (B, L)
        while True:
            seen = np.isin(_keys(digits), self._val_keys)  # (B,)
            if not seen.any():
                return encode(digits, self.task)
            digits[seen] = self._rng.integers(0, 10, size=(int(seen.sum()), self.length))

    def val_batch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``encode`` of the held-out digit strings."""
        return encode(self.val_digits, self.task)
