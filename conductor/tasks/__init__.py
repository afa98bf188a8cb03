"""Celery: the app, its queues and routes, and the thin tasks that call ``conductor.engine``."""
