"""Training strategies, and everything a new one is written with (docs/architecture.md, "Adding a strategy")."""

from ..core.contract import put_batch as put_batch
from ..core.placement import LeafPlacement as LeafPlacement
from ..core.placement import bytes_by_part as bytes_by_part
from ..core.placement import total_bytes as total_bytes
from ..core.reports import ExpectedCollective as ExpectedCollective
from ..core.reports import Sizes as Sizes
from ..core.state import TrainState as TrainState
from ..core.state import create_state as create_state
from ..core.step import Step as Step
from ..core.step import train_step as train_step
from . import offdevice as offdevice
from .base import Strategy as Strategy
from .context_parallel import ContextParallel as ContextParallel
from .expert_parallel import ExpertParallel as ExpertParallel
from .fully_sharded import FullySharded as FullySharded
from .hybrid import Hybrid as Hybrid
from .mirrored import Mirrored as Mirrored
from .mirrored import MirroredJit as MirroredJit
from .multiworker import MultiWorkerMirrored as MultiWorkerMirrored
from .offdevice import CentralStorage as CentralStorage
from .offdevice import ParameterServer as ParameterServer
from .parallel import Parallel as Parallel
from .pmap import MirroredPmap as MirroredPmap
from .single import SingleDevice as SingleDevice
from .spmd import SPMD as SPMD
from .tensor import TensorParallel as TensorParallel

# isort: split
from . import catalog as catalog  # last: its entries build the strategies above (and the pipeline)
