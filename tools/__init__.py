"""Project tools run as modules (python -m tools.<name>)."""
