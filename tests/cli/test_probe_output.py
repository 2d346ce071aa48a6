"""What `autofit probe` prints: the breakdown at the peak reads as what it is."""


def test_a_breakdown_at_the_peak_says_why_a_kind_is_zero():
    """A full fine-tune's probe showed "gradients 0 B" with no word why: the breakdown is what was alive at the peak."""
    from autofit.commands.common import breakdown_lines

    lines = breakdown_lines({"parameters": 2**20, "gradients": 0, "activations": 3 * 2**20}, 4 * 2**20)
    gradients = next(line for line in lines if "gradients" in line)
    assert gradients.split() == ["gradients", "0", "B", "(none", "alive", "at", "the", "peak)"]
    assert lines[-1].split()[:3] == ["peak", "4.00", "MiB"] and "alive at that moment" in lines[-1]
    assert "(none" not in next(line for line in lines if "parameters" in line)
