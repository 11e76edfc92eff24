"""Small C kernels nbserve compiles for this machine at first use (see `build.py`)."""

GATED, ROUND16 = 1, 2  # the matmul entry points' flags (quant_matmul.c)
