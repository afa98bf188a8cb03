"""Webhooks (Standard Webhooks): signing, the SSRF rules for targets, and delivering one attempt."""
