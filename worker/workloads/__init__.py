"""Workloads: a model, its data and its loss, built deterministically from a seed.

See docs/workloads.md for bringing your own model with ``--workload module:function``.
"""

from psar.worker.workloads.base import Workload, WorkloadFactory
from psar.worker.workloads.loader import BUILTINS, load_workload, resolve_factory

__all__ = ["BUILTINS", "Workload", "WorkloadFactory", "load_workload", "resolve_factory"]
