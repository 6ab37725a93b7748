"""Topology file, topology graph and migration cost model (imports nothing else of hilum)."""
