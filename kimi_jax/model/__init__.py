"""The functional K2.6 text decoder."""
