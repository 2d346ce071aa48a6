"""What is measured before a plan is written: the runs' peaks and timings, the floor, the ladder below the floor,
and the verification of the best candidates."""
