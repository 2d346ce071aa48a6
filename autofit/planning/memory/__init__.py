"""Memory of many configurations: traces and their segments, the levers' and the optimizer's bytes, headroom, one rank's share, and the workers that trace."""
