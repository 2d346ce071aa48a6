"""`autofit --version` prints the one version autofit/version.py holds."""
import autofit
from autofit.version import __version__


def test_version_flag_prints_the_package_version(run_cli):
    code, out, err = run_cli("--version")
    assert (code, out, err) == (0, f"autofit {__version__}\n", "")
    assert autofit.__version__ == __version__ == "0.1.0"
