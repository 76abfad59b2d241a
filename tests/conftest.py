"""Suite-wide settings.

One torch thread per test process: the suite runs under pytest-xdist with one worker per core, and two
OpenMP threads per worker on a 2-core machine spin against each other (measured here: a mini-model
batch took 6.4 s with 2 threads beside another busy process, 0.5 s with 1).
"""

import torch

torch.set_num_threads(1)
