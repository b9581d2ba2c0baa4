"""Where users already train: Hugging Face Trainer (``integrations.transformers``)."""
