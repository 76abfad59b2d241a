"""OpenAI-compatible HTTP server over one engine loop."""
