"""Command-line entry points: ``hilum`` (simulator, topology tools, cluster) and ``hilumctl`` (admin CLI)."""
