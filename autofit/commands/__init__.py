"""One module per CLI command; each registers itself on ``autofit.cli.app``."""
