"""`launch serve`: an OpenAI-compatible HTTP server on rank 0 (FastAPI + uvicorn), with Prometheus
metrics; the engine runs on its own thread and batches concurrent clients together."""
