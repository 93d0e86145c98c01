"""The OpenAI-compatible HTTP server (`gyrfalcon serve`); see docs/server.md."""
