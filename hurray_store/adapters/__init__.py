"""Bridges to other systems: transformers models, LMCache."""
