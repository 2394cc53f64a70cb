"""Bridges to other systems (layer L5): transformers models, LMCache."""
