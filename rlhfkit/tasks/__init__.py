"""Built-in verifiable tasks for the quickstart and tests (generated offline)."""
