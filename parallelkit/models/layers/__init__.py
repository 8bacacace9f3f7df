"""The layers the kit's models call, those that communicate among them: :mod:`.basic`, :mod:`.attention`,
:mod:`.experts`, :mod:`.sequence`."""

from . import attention as attention
from . import basic as basic
from . import experts as experts
from . import sequence as sequence
