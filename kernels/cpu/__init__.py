"""Kernels for the host CPU: C sources built once by the system's compiler (build.py), called through ctypes."""
