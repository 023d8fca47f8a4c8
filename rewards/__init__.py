"""Reward functions and task data: pure Python, no torch, no Ray."""
