"""The XLA FFI binding: runtime library and handlers (``runtime``), the persistent kernel cache
(``cache``), ahead-of-time compilation (``compiler``, needs nvidia-cutlass-dsl) and the JAX
primitive that calls a compiled kernel (``call``)."""
