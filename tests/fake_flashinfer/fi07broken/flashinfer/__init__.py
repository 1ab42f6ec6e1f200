"""A flashinfer whose moe_ep exists but breaks while importing (a dependency it needs is missing)."""
