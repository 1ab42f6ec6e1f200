"""Stand-in flashinfer 0.6.18 (the trtllm MoE all-to-all generation), CPU semantics from _a2a_fabric."""
