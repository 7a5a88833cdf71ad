"""Flide: packed shared-context classification (one pass, exact)."""
