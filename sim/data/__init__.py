"""Bundled request-trace files for ``sim.traces`` (package data; origins and licences in ATTRIBUTION.md)."""
