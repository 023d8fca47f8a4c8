"""Environments for multi-turn episodes: the interface, in-process and remote sessions, and the reference service."""
