"""The routed experts: the interface the MoE layer calls, its torch reference, the decode and prefill kernels."""
