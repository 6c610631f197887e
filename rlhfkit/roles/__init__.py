"""rlhfkit."""
