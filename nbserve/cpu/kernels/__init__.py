"""Small C kernels nbserve compiles for this machine at first use (see `build.py`)."""
