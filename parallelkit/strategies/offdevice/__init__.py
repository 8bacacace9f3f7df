"""The strategies that keep the state off the compute devices: central storage and parameter servers.

Both run a step in three stages, pull, compute, push and update (:mod:`.rows`), with the
state in host memory at one owner (:mod:`.central`) or cut into shards
(:mod:`.parameter_server`, its cut in :mod:`.partition`, its asynchronous mode in
:mod:`.asynchronous`, the check that an optimizer's update may be split in
:mod:`.split_update`). :class:`~.base.OffDeviceStrategy` is their family base.
"""

from .base import OffDeviceStrategy as OffDeviceStrategy
from .central import CentralStorage as CentralStorage
from .parameter_server import ParameterServer as ParameterServer
