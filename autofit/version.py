"""autofit's version: one place, read by ``autofit.__version__`` and ``autofit --version``."""

__version__ = "0.1.0"
