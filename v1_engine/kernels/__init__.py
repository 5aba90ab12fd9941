"""Kernels: Triton modules beside their wrappers, and the ctypes binding of the compiled library."""
