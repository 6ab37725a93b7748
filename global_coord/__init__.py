"""global_coord — see DESIGN.md; built in a later issue."""
