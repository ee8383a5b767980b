"""The training layer (docs/architecture.md, section 2): the Trainer, one optimizer step, the
microbatch runner and the wiring that builds them; `python -m torchtitan.train` is the entry."""
