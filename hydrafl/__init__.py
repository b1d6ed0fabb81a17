"""hydrafl: federated fine-tuning of transformers for hospital consortia, built on Flower.

Importing the package turns off Flower's telemetry and update check and keeps Hugging Face offline,
so every entry point (CLI, apps, tests) behaves the same on an air-gapped hospital machine.
"""

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

__version__ = "0.1.0"
