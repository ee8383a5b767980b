"""Checks run before launch: config validation (``load_config``, ``validate_config``) and the
pipeline stages a config asks for. Above ``config``, ``models`` and ``distributed`` in the layering
(docs/architecture.md, section 2)."""
