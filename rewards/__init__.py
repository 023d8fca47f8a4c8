"""Scoring completions: rule and step verifiers, the remote verifier client and service, reward shaping, process
supervision's steps, environments (`rewards/environments/`), and their config."""
