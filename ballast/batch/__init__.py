"""OpenAI's Batch API on a durable queue (issue 62)."""
