"""The OpenAI-compatible HTTP server: inference and fine-tuning jobs over one co-serving engine."""
