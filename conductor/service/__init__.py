"""The HTTP API (FastAPI) and the ``conductor`` command line."""
