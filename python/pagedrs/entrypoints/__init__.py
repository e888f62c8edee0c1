"""Command-line and HTTP entry points."""
