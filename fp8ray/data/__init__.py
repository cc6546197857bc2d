"""Ray Data callables (see issue 11)."""
