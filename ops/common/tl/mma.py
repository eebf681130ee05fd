"""One mma.sync tile on operands held in registers (the PTX fragment layouts), for kernels that place their own
fragments: the htree layer and backward kernels, the paged decode's warp-split kernel."""

import tilelang.language as T


def mma(a, ai, b, bi, c, ci, dtype: str = "float32"):
    """c[ci:ci+4] += a @ b for one tile held in registers, in the PTX fragment layouts: fp32 as an m16n8k8 TF32
    tile (a at ai, four values; b at bi, two), 16-bit as m16n8k16 (eight and four); c four fp32."""
    shape, ab = {"float32": ("m16n8k8", "tf32"), "float16": ("m16n8k16", "fp16"),
                 "bfloat16": ("m16n8k16", "bf16")}[dtype]
    return T.ptx_mma("float32", shape, "row", "col", ab, ab, "fp32", a.data, ai, b.data, bi, c.data, ci, False)
