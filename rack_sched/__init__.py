"""rack_sched — see DESIGN.md; built in a later issue."""
