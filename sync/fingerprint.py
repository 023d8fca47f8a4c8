"""Exact fingerprints of weights, for checking that every engine received exactly the learner's weights of a version.

Owns: `fingerprint` (a short digest per tensor, over its bits in the dtype the engines serve: `tensor_fingerprint`).
The learner fingerprints its weights cast to the engines' dtype; each rollout worker fingerprints the tensors it
received and handed to its engine, whichever transport brought them. Unlike the logprob probe this does not depend on
numerics, so it is as exact in bfloat16 as in float32.
Does not own: the comparison and a version's `digest` (sync/verify.py: plain strings, so the driver, which compares,
needs no torch), moving weights (sync/transport.py) or the probe. Imports only torch and numpy: it runs inside vLLM's
worker processes too.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable

import numpy as np
import torch

ROW = 1 << 15  # elements per row: |column-weighted sum of a row| < 2^15 * 2^15 * 2^15, far inside int64


def fingerprint(named: Iterable[tuple[str, torch.Tensor | np.ndarray]]) -> dict[str, str]:
    """{name: fingerprint} of every (name, tensor), as a worker reports what it handed its engine (a tied head that
    arrived under two names is two tensors there, each checked)."""
    return {name: tensor_fingerprint(tensor) for name, tensor in dict(named).items()}


def tensor_fingerprint(tensor: torch.Tensor | np.ndarray) -> str:
    """16 hex digits over the tensor's dtype, shape and three exact integer sums over its bits read as 16-bit integers
    (bytes for 1-byte dtypes), laid out in rows of `ROW`: the plain sum, the sum weighted by column and the sum
    weighted by row. Any change of one element changes the plain sum; moved elements change a weighted one. Integer
    sums do not depend on the order of the reduction, so numpy on the host and torch on a GPU (where NCCL delivers
    tensors) agree bit for bit (docs/benchmarks.md, "GPU learner"), and both run at memory speed (a cryptographic
    hash of the bytes runs well below it on the host and does not run on a GPU)."""
    if isinstance(tensor, np.ndarray):
        with warnings.catch_warnings():  # read-only (zero-copy from Ray's object store): only read here
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(np.ascontiguousarray(tensor))
    flat = tensor.detach().reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    bits = flat.view(torch.uint8) if flat.element_size() == 1 else flat.view(torch.int16)
    plain, by_column, by_row = (_sums_on_host if bits.device.type == "cpu" else _sums_on_device)(bits)
    text = f"{str(tensor.dtype).removeprefix('torch.')}|{tuple(tensor.shape)}|{plain}|{by_column}|{by_row}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _sums_on_host(bits: torch.Tensor) -> tuple[int, int, int]:
    values = bits.numpy()
    full = len(values) // ROW * ROW
    rows = values[:full].reshape(-1, ROW)
    return _combine(rows.sum(axis=1, dtype=np.int64), rows.sum(axis=0, dtype=np.int64),
                    values[full:].astype(np.int64))


def _sums_on_device(bits: torch.Tensor) -> tuple[int, int, int]:
    full = len(bits) // ROW * ROW
    rows = bits[:full].view(-1, ROW)
    return _combine(rows.sum(dim=1, dtype=torch.int64).cpu().numpy(), rows.sum(dim=0, dtype=torch.int64).cpu().numpy(),
                    bits[full:].to(torch.int64).cpu().numpy())


COLUMNS = np.arange(1, ROW + 1, dtype=np.int64)


def _combine(row_sums: np.ndarray, column_sums: np.ndarray, tail: np.ndarray) -> tuple[int, int, int]:
    """The three sums from the full rows' sums, the columns' sums over the full rows and the last, partial row's
    elements. Exact: int64 where the bounds allow it (|column sum| < 2^15 rows x 2^15, times a weight < 2^15+1, over
    2^15 columns stays under 2^63 below 2^17 rows), Python integers elsewhere."""
    plain = int(row_sums.sum()) + int(tail.sum())
    if len(row_sums) < 1 << 17:
        by_column = int(column_sums @ COLUMNS)
    else:  # a tensor of 2^32 or more 16-bit values
        by_column = sum(c * s for c, s in enumerate(column_sums.tolist(), 1))
    by_column += int(tail @ COLUMNS[:len(tail)])
    by_row = sum(r * s for r, s in enumerate(row_sums.tolist(), 1)) + (len(row_sums) + 1) * int(tail.sum())
    return plain, by_column, by_row
