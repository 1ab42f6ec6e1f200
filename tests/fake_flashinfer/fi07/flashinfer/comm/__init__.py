"""Stand-in flashinfer.comm 0.7: trtllm_moe_alltoall is gone."""
