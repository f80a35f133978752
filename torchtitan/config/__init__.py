from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import ConfigError, ConfigManager, config_to_toml

__all__ = ["JobConfig", "ConfigError", "ConfigManager", "config_to_toml"]
