"""TileLang building blocks shared by several operators' kernels: radix-select steps (``radix``) and
online-softmax pieces (``softmax``). Each is a ``T.macro`` (inlined where it is called)."""
