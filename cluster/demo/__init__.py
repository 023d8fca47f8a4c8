"""The built-in demo: the `a+b=` arithmetic task (`task`) and the small local model that learns it (`model`)."""
