"""Stand-in flashinfer 0.5.3: no MoE all-to-all and no PCIe IPC collectives."""
