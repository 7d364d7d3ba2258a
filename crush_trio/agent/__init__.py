"""The agent shell: the turn runner, run records and session titles."""
