"""The host CPU's C kernels (routed experts, FP8 linear): built once by the system's compiler, called via ctypes."""
