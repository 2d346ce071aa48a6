"""Speed of many configurations: interleaved timing rounds and their noise, steps timed on the device, speed
estimated from FLOPs, and what the levers cost in time."""
