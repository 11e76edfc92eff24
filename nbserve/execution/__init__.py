"""How a model's step runs fast: the weights' serving forms (float32, oneDNN-packed, float16,
quantized blocks) and their matmul dispatch, the C kernels' Python faces, paged attention, the
decode stack (a step's layers in one C call), static decode steps for CUDA graphs and the paged
KV cache. The architecture (nbserve.models) imports this package, never the reverse: what it
needs of a model is declared here as Protocols."""
