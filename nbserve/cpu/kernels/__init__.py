"""Small C kernels nbserve compiles for this machine at first use (see `build.py`); their
interface is declared once, in `nbserve_kernels.h`, and read from there by `abi.py`."""
