"""Evaluation: run a dataset through planners as ordinary jobs, score the answers, store rewards."""
