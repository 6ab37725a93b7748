"""sim — see DESIGN.md."""
