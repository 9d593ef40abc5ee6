"""Gradient compressors for DistributedOptimizer, named as in Horovod."""

import torch


class NoneCompressor:
    """Sends gradients as they are.

    A compressor is any object with compress(tensor) -> (wire, ctx) and
    decompress(wire, ctx) -> tensor. One that only changes the dtype may also
    define wire_dtype(dtype): buckets then cast with copy_ into their
    preallocated buffers instead of calling compress/decompress, which allocate.
    """

    @staticmethod
    def wire_dtype(dtype):
        return dtype

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor:
    """Halves the bytes of floating gradients on the wire; other dtypes pass unchanged."""

    @staticmethod
    def wire_dtype(dtype):
        return torch.float16 if dtype.is_floating_point else dtype

    @staticmethod
    def compress(tensor):
        return tensor.to(FP16Compressor.wire_dtype(tensor.dtype)), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx)


class Compression:
    """The built-in compressors, named as in Horovod."""

    none = NoneCompressor
    fp16 = FP16Compressor
