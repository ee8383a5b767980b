"""Job configuration: dataclasses, TOML + command-line parsing (validation: torchtitan.preflight)."""

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import parse_args, to_toml

__all__ = ["ConfigError", "JobConfig", "parse_args", "to_toml"]
