"""TileLang kernels of HSA decode, by family: page reprs (``page_repr``), scores (``score``), top-k
(``topk``, with its radix-select fallback in ``radix_select``), sparse decode and its combine
(``decode``). Each builder returns a ``T.prim_func`` whose name is the CUDA kernel's."""
