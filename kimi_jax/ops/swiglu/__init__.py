"""SwiGLU at decode and verify widths (the shared expert's, on a GPU two launches): ``api.swiglu``."""
