"""psar: train the same PyTorch model under a parameter server or ring-allreduce.

The one import name of the project: its folders install under it (``psar.ps`` is ps/,
``psar.worker`` is worker/, ``psar.allreduce`` is allreduce/, ``psar.trainkit`` is
trainkit/), so a user's own ``worker.py`` or ``ps.py`` never shadows psar's code.
"""

__version__ = "0.1.0"
