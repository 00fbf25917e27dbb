"""tests/elastic."""
