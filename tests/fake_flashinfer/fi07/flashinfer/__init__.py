"""Stand-in flashinfer 0.7.4 (the moe_ep generation), CPU semantics from _a2a_fabric."""
