"""The training loop's optional features, one hook per module (``base.py``: the interface;
``build.py``: the hooks of a run; docs/architecture.md, "Adding a feature hook")."""
