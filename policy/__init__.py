"""policy — see DESIGN.md."""
