"""Multi-host training: resolve the cluster, join it, and run local clusters. Importing it neither imports JAX nor
calls ``jax.distributed``.

>>> from parallelkit import distributed
>>> distributed.resolve_cluster(env={}).describe()[:14]
'single process'
"""

from .cluster import ClusterError as ClusterError
from .cluster import ClusterSpec as ClusterSpec
from .cluster import resolve_cluster as resolve_cluster
from .launcher import LaunchError as LaunchError
from .launcher import ProcessReport as ProcessReport
from .launcher import launch as launch
from .launcher import run_local as run_local
from .progress import ForwardProgress as ForwardProgress
from .progress import ReportProgress as ReportProgress
from .runtime import initialize as initialize
