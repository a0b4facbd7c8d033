"""Model replicas: engines, the replica deployment, GPU probes, chaos, request routing."""
