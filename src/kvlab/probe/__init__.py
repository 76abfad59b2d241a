"""Black-box isolation probe of any OpenAI-compatible server."""
