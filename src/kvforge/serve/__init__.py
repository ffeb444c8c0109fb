"""OpenAI-compatible HTTP server (FastAPI + uvicorn) on the engine, with Prometheus metrics."""
