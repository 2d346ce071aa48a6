from autofit.entry import run

run()
