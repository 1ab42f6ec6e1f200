"""Stand-in flashinfer.comm 0.6: the allreduce names the probes do not use here are left out."""
