"""Measuring ONE configuration: the storage tracker, the three meters, the probe and block profiles."""
