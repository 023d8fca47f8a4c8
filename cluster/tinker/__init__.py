"""The Tinker API served on relay's actors (`relay serve`, docs/tinker.md)."""
