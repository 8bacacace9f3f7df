"""Training strategies: each decides where state lives and how gradients meet."""

from .base import LeafPlacement as LeafPlacement
from .base import Step as Step
from .base import Strategy as Strategy
from .base import TrainState as TrainState
from .mirrored import Mirrored as Mirrored
from .single import SingleDevice as SingleDevice
