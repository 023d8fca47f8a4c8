"""The built-in demo: its tasks (`task`: `a+b=` arithmetic, `12+34+56=` chained sums, `37*48=` products for the
calculator tool) and the small local models that learn them (`model`, and `calc` for the tool task's warm-up)."""
