"""The strategies that keep the state off the compute devices: central storage and parameter servers."""

from .base import OffDeviceStrategy as OffDeviceStrategy
from .central import CentralStorage as CentralStorage
from .parameter_server import ParameterServer as ParameterServer
