"""The deployments' names, which every part of the server refers to."""

MODEL_DEPLOYMENT = "BallastModel"
FALLBACK_DEPLOYMENT = "BallastFallbackModel"
ROUTER_DEPLOYMENT = "BallastRouter"
CHAOS_TARGETS = {"primary": MODEL_DEPLOYMENT, "fallback": FALLBACK_DEPLOYMENT}
