"""A written plot is checked as an image, not as a file that exists."""

import matplotlib.image
import numpy as np


def assert_plotted(path):
    """The figure decodes as an image and holds more than its background (its panels were drawn)."""
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 10
