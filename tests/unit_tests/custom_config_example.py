"""A user's config extension (used by test_config.py): a new section and a new field in an
existing section."""

from dataclasses import dataclass, field


@dataclass
class CustomSection:
    knob: int = 1
    """An example knob."""


@dataclass
class Training:
    my_extra_flag: bool = False
    """A field added to the existing training section."""


@dataclass
class JobConfig:
    custom_section: CustomSection = field(default_factory=CustomSection)
    training: Training = field(default_factory=Training)
