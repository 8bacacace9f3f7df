"""The strategies that keep the state off the compute devices: central storage and parameter servers.

Both run a step in three stages, pull, compute, push and update (:mod:`.rows`), with the
state in host memory at one owner (:mod:`.central`) or cut into shards
(:mod:`.parameter_server`, its cut in :mod:`.partition`, its asynchronous mode in
:mod:`.asynchronous`). :class:`~.base.OffDeviceStrategy` is their family base. The check that an
optimizer's update may be split, which the pipeline runs too, is beside both in
:mod:`parallelkit.strategies.split_update`.
"""

from .base import OffDeviceStrategy as OffDeviceStrategy
from .central import CentralStorage as CentralStorage
from .parameter_server import ParameterServer as ParameterServer
