from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import ConfigManager, config_to_toml, save_config_file

__all__ = ["JobConfig", "ConfigError", "ConfigManager", "config_to_toml", "save_config_file"]
