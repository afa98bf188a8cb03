"""Persistence: tables in ``models``, engines in ``db``, data-access functions in ``jobs`` and ``keys``."""
