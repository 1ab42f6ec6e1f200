"""Results: the typed result, the store, provenance, freshness, manifests."""
