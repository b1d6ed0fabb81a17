"""Shared local-training kernels every site (and the simulation) trains with."""
