"""The mHC TileLang kernel builders, one module per family: ``phi_split`` (phi's bf16 hi + lo copy),
``fwd_mix`` (the forward's two-kernel path and its side kernel), ``fwd_fused`` (the forward's single pass
on 16-CTA clusters), ``bwd_two_pass`` (the backward's stats and grad kernels), ``bwd_one_pass`` (the
backward in one launch), ``phi_sum`` (grad_phi from its per-group partials), ``sinkhorn`` (h_res logits to
comb and back, one thread per token), ``post`` and ``post_pre`` (the post step, and post fused with the next
pre's mix); ``weights`` holds the pre weights' formulas the forward epilogues share. Each builder returns a
``T.prim_func`` whose name is the CUDA kernel's."""
