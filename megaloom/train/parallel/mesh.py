"""The trainer's device mesh: ``world = dp x cp x tp``, experts split ``dp x cp = edp x ep``.

    rank = (dp_i * cp + cp_i) * tp + tp_i          (tp fastest, as init_device_mesh lays it out)

- ``tp`` ranks hold one replica's attention heads and MLP columns (same tokens);
- ``cp`` ranks hold one sequence's consecutive parts (same batch);
- ``dp`` ranks read different batches; FSDP shards over the ``dp x cp`` ranks ("dp_cp");
- ``ep`` consecutive ``dp x cp`` ranks (same tp coordinate) split the experts; the ``edp``
  groups of ranks holding the same experts replicate them.

:func:`MeshDims.of` checks ``parallel`` against the world and names the keys of every
problem; :func:`build` makes the torch DeviceMeshes and megaloom communicators of this rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megaloom.runtime.errors import ConfigError


@dataclass(frozen=True, slots=True)
class MeshDims:
    """Sizes of the mesh dimensions (``dp`` is what ``tp`` and ``cp`` leave of the world)."""

    world: int
    dp: int
    cp: int
    tp: int
    ep: int

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        return self.dp_cp // self.ep

    @staticmethod
    def of(par: dict, world: int) -> MeshDims:
        tp, cp, ep = par["tp_size"], par["cp_size"], par["ep_size"]
        if world % (tp * cp):
            raise ConfigError(f"invalid parallel layout:\n  parallel.tp_size={tp} x parallel.cp_size={cp} = "
                              f"{tp * cp} ranks per data-parallel replica does not divide the world size {world}")
        if (world // tp) % ep:
            raise ConfigError(f"invalid parallel layout:\n  parallel.ep_size={ep} does not divide the {world // tp} "
                              f"data x context ranks (world size {world} / parallel.tp_size={tp}); experts are split "
                              "over those")
        return MeshDims(world, world // (tp * cp), cp, tp, ep)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along every dimension (dp, cp, tp, dp_cp, ep, edp)."""
        dp_cp, tp_i = divmod(rank, self.tp)
        dp_i, cp_i = divmod(dp_cp, self.cp)
        edp_i, ep_i = divmod(dp_cp, self.ep)
        return {"dp": dp_i, "cp": cp_i, "tp": tp_i, "dp_cp": dp_cp, "ep": ep_i, "edp": edp_i}


@dataclass(slots=True)
class Mesh:
    """This rank's view of the mesh: DeviceMeshes for torch (FSDP2, TP) and communicators for megaloom
    (None where a dimension has one rank)."""

    dims: MeshDims
    rank: int
    fsdp_mesh: Any = None   # DeviceMesh over dp_cp
    tp_mesh: Any = None     # DeviceMesh over tp
    world: Any = None       # Communicators (without the per-call shape checks: the trainer's calls agree)
    dp_cp: Any = None
    cp: Any = None
    ep: Any = None
    edp: Any = None

    def coord(self, dim: str) -> int:
        return self.dims.coords(self.rank)[dim]


def build(dims: MeshDims, comm: Any, backend: str, wrap=lambda c: c) -> Mesh:
    """The DeviceMeshes and sub-communicators of ``comm``'s rank; ``wrap`` decorates each communicator
    (the trainer times their collectives). A world of one has none."""
    mesh = Mesh(dims, comm.rank)
    if dims.world == 1:
        return mesh
    from torch.distributed.device_mesh import init_device_mesh

    from megaloom.comm.torch_comm import TorchCommunicator

    device = "cuda" if backend == "nccl" else "cpu"

    def sub(m):  # None for a dimension of one rank
        return wrap(TorchCommunicator(group=m.get_group(), timeout=comm.timeout, check=False)) if m.size() > 1 else None

    mesh.world = wrap(TorchCommunicator(group=getattr(comm, "group", None), timeout=comm.timeout, check=False))
    root = init_device_mesh(device, (dims.dp, dims.cp, dims.tp), mesh_dim_names=("dp", "cp", "tp"))
    mesh.fsdp_mesh = root["dp", "cp"]._flatten("dp_cp")
    mesh.tp_mesh = root["tp"]
    mesh.dp_cp, mesh.cp = sub(mesh.fsdp_mesh), sub(root["cp"])
    if dims.ep > 1:
        experts = init_device_mesh(device, (dims.edp, dims.ep, dims.tp), mesh_dim_names=("edp", "ep", "tp"))
        mesh.ep, mesh.edp = sub(experts["ep"]), sub(experts["edp"])
    return mesh
