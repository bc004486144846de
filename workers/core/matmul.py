"""Half-precision products with fp32 results: out_dtype=float32 where torch's GEMM takes it, else an upcast.

torch's mm/addmm take `out_dtype=torch.float32` for bf16/fp16 inputs on CUDA: the GEMM accumulates in fp32
(as it always does) and writes fp32, so the product is never rounded to the half dtype and no fp32 copy of
an input is made. Elsewhere (the CPU, fp32/fp64 inputs) the inputs are upcast instead.
"""

from __future__ import annotations

import functools

import torch

HALF = (torch.bfloat16, torch.float16)


@functools.cache
def fp32_products(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's mm/addmm take out_dtype=float32 for `dtype` inputs on `device` (CUDA, bf16/fp16),
    with a transposed view as an operand and an fp32 `out` accumulated in place (checked once per pair)."""
    if device.type != "cuda" or dtype not in HALF:
        return False
    try:
        a = torch.ones(3, 2, dtype=dtype, device=device)
        acc = torch.ones(2, 2, dtype=torch.float32, device=device)
        torch.addmm(acc, a.T, a, out_dtype=torch.float32, out=acc)
        prod = torch.mm(a, a.T, out_dtype=torch.float32)
        return bool((acc == 4).all()) and bool((prod == 2).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of two 2-D tensors of one dtype, the result in at least fp32 (fp64 stays fp64)."""
    if a.dtype not in HALF:
        return torch.mm(a, b) if a.dtype == torch.float64 else torch.mm(a.float(), b.float())
    if fp32_products(a.device, a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())
