"""proto — see DESIGN.md; built in a later issue."""
