"""The attention of a lone decode step through nbserve's C kernel (kernels/lone_attention.c).

A lone step's attention is about fifteen small torch ops a layer (rope, two cache writes,
slicing, two batched matmuls, softmax, casts); at one token each costs more in dispatch than in
arithmetic. One C call does the same work (benchmarks/README.md has the figures).
"""

from __future__ import annotations

import torch

from ..cpu.kernels.build import quant_kernels


def lone_attention_serves(heads: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          rope: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether the kernel can take this step: CPU float32, contiguous tensors."""
    tensors = (heads, keys, values, *rope)
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
               for t in tensors)


def lone_attention(heads: torch.Tensor, hq: int, hkv: int, rope: tuple[torch.Tensor, torch.Tensor],
                   keys: torch.Tensor, values: torch.Tensor, pos: int) -> torch.Tensor:
    """Rope the token's q/k heads, write its k and v into `keys`/`values` (hkv, ctx, d) at
    `pos`, attend over positions 0..pos; heads (hq + 2 hkv, d) -> out (1, hq * d)."""
    d = heads.shape[-1]
    cos, sin_signed = rope
    out = torch.empty(1, hq * d, dtype=torch.float32)
    failed = quant_kernels().nbq_lone_attention(
        heads.data_ptr(), hq, hkv, d, cos.data_ptr(), sin_signed.data_ptr(), keys.data_ptr(),
        values.data_ptr(), keys.shape[1], pos, out.data_ptr(), torch.get_num_threads())
    if failed:
        raise MemoryError("lone attention: out of memory for its scratch buffers")
    return out
