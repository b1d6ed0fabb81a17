"""Side-by-side measurements; each module prints a table and writes JSON/PNG under its --out."""
