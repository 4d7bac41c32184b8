"""The DFlash drafter's attention (GQA over its context rows and its own block) as one op: ``api.attend``."""
