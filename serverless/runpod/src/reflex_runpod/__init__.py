"""Runpod queue-endpoint worker: docs/serverless.md."""
