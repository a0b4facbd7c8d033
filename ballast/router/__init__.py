"""The HTTP ingress: the router deployment, gate, resilience, idempotency, ingress settings."""
