"""llumlet — see DESIGN.md."""
