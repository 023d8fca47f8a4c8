"""Scoring completions: rule verifiers, the remote verifier client and service, reward shaping, and their config."""
