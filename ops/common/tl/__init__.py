"""TileLang building blocks shared by several operators' kernels: radix-select steps (``radix``), online-softmax
pieces (``softmax``) and an mma.sync tile on register fragments (``mma``). Each is inlined where it is called."""
