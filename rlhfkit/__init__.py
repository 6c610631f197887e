"""rlhfkit: RLHF and agentic RL for language models."""

__version__ = "0.1.0"
