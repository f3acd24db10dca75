"""Process groups and collectives: the ``(dp, sp)`` mesh (also DeepSpeed's ``mpu``), the Ulysses
all-to-alls as autograd Functions, the device each collective uses, and failures of an SP group
turned into errors that name it. Imports torch only."""

from .all_to_all import HeadLayout, HeadsToSeq, SeqToHeads
from .collectives import collective_device
from .mesh import Mesh, build_mesh, check_mesh_param, mesh_shape
from .watch import GroupWatch, SPCommError

__all__ = ["HeadLayout", "HeadsToSeq", "SeqToHeads", "collective_device", "Mesh", "build_mesh", "check_mesh_param",
           "mesh_shape", "GroupWatch", "SPCommError"]
