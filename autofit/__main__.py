from autofit.cli import run

run()
