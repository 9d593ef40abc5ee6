"""Gradient compressors for DistributedOptimizer, named as in Horovod."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Compressor(Protocol):
    """What DistributedOptimizer calls on a compressor (see NoneCompressor); ``ctx`` is
    whatever its compress hands its decompress."""

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]: ...

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor: ...


class NoneCompressor:
    """Sends gradients as they are.

    A compressor is any object with compress(tensor) -> (wire, ctx) and
    decompress(wire, ctx) -> tensor. One that only changes the dtype may also
    define wire_dtype(dtype): buckets then cast with copy_ into their
    preallocated buffers instead of calling compress/decompress, which allocate.
    """

    @staticmethod
    def wire_dtype(dtype: torch.dtype) -> torch.dtype:
        return dtype

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, None]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: None) -> torch.Tensor:
        return tensor


class FP16Compressor:
    """Halves the bytes of floating gradients on the wire; other dtypes pass unchanged."""

    @staticmethod
    def wire_dtype(dtype: torch.dtype) -> torch.dtype:
        return torch.float16 if dtype.is_floating_point else dtype

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        return tensor.to(FP16Compressor.wire_dtype(tensor.dtype)), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        return tensor.to(ctx)


class Compression:
    """The built-in compressors, named as in Horovod."""

    none = NoneCompressor
    fp16 = FP16Compressor
