"""PyTorch reference implementations (readable; they define each operator's semantics)."""
