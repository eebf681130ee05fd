"""The htree forward's TileLang kernels, by family: ``pool_rope`` (tree layers, rotated K), ``top`` (the top
layer's lse, keys and merge), ``walk`` (the per-row walk down the tree), ``layer0`` / ``layer16`` (the layers
below the walk from register fragments), ``select`` (the radix top-k select and the winners' compaction) and
``fragments`` (pieces they share); the backward's ``bwd_top`` (the top layer's dq and dK/dV), ``bwd_rows`` (the lower
layers' dq), ``bwd_nodes`` (the lower layers' dK/dV), ``bwd_tree`` (D, the mean pooling's gradient) and
``bwd_common``. See docs/design/htree.md."""
