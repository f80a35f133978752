"""Memory estimation: trace a training step on fake tensors under a fake process group
(``trace``), cross-check it with a closed form (``analytic``), plan layouts (``planner``) and
validate against a real run (``measure``). Entry point: ``scripts/estimate/estimation.py``."""
