"""Memory estimation: trace a training step on fake tensors under a fake process group
(``trace``, with ``emulation`` making the trace match a real device and ``memory_tracker``
counting it), cross-check it with a closed form (``closed_form``), plan layouts
(``layout_search``, ``plan_mode``) and measure a real run beside the estimate
(``measure_mode`` on ``real_steps``). Entry point: ``scripts/estimate/estimation.py``."""
