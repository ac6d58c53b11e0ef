"""Integrations of kvd with inference engines, in their worker processes (each imports its engine
only when imported itself)."""
