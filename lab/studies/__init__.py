"""Scripts and tables of the papers' two studies at small scale (docs/results.md)."""
