"""Conductor Queue: durable Conductor workflows on Celery and Postgres."""
