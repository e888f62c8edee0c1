"""Completions, and beam search for both APIs."""
