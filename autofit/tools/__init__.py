"""What comes after training: validation, curve plots, the before/after comparison and export."""
