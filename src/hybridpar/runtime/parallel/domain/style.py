"""DomainStyle: what a segment split by height (or into tiles) runs: each windowed module's
stand-in, instance and group norms over the ranks of a band, global poolings summed over them;
parameters whole on every rank, their gradients summed over all P."""

from __future__ import annotations

from torch import nn

from hybridpar.core import ops
from hybridpar.core.layers import CostLayer
from hybridpar.runtime.comm.group import Group
from hybridpar.runtime.parallel.batchnorm import BandStatistics
from hybridpar.runtime.parallel.domain.reductions import SpaceReduction
from hybridpar.runtime.parallel.domain.windows import STAND_INS
from hybridpar.runtime.parallel.styles import ParallelStyle


class DomainStyle(ParallelStyle):
    """domain(Pr x Pc): a segment's convolutions and poolings on bands of rows with halos, its
    other layers on the bands as they are; parameters whole on every rank."""

    kind = "domain"

    def shard(self, name: str, module: nn.Module, layer: CostLayer) -> nn.Module:
        windows = {w.member: w for w in layer.windows}
        group, ledger = self.grid.model_group, self.ctx.ledger
        pool = next((p for p in layer.pools if p.member == name), None)
        if name in layer.unchanged or (self.spec.pr == 1 and pool):
            return module  # a whole value's, or over a band's channels: unchanged
        pw = self.spec.pw
        if pool:
            stand_in = SpaceReduction(pool, True, group, ledger, layer.name, pw)
            ops.install(module, stand_in, name=name)
            return module
        op = ops.own_op(module)
        if op is not None and op.stand_in == "stats" and self.spec.pr > 1:
            stats = BandStatistics(module, group, ledger, layer.name, self.grid.batch_group, pw)
            ops.install(module, stats, name=name)
            return module
        if name not in windows:
            return module
        stand_in = STAND_INS[op.stand_in](
            module, windows[name].row_map(), group, ledger, layer.name, **self._tiles(name, layer)
        )
        ops.install(module, stand_in, name=name)
        return module

    def site(self, name: str, owner: nn.Module, layer: CostLayer) -> None:
        """An F.interpolate, an F.pixel_shuffle or a global pooling in a module's own forward
        (core.ops.install_site)."""
        windows = {w.member: w for w in layer.windows}
        pool = next((p for p in layer.pools if p.member == name), None)
        _, func, k = ops.site_func(name)
        group, ledger = self.grid.model_group, self.ctx.ledger
        if name in windows:
            tiles = self._tiles(name, layer)
            cls = STAND_INS[ops.site_operation(func).stand_in]
            stand_in = cls(owner, windows[name].row_map(), group, ledger, layer.name, **tiles)
            ops.install_site(owner, func, k, stand_in)
        elif pool and self.spec.pr > 1:
            adaptive = func.__name__.startswith("adaptive")
            reduction = SpaceReduction(pool, adaptive, group, ledger, layer.name, self.spec.pw)
            ops.install_site(owner, func, k, reduction)

    def _tiles(self, name: str, layer: CostLayer) -> dict:
        """On tiles: the column map of `name`'s window and the tile columns."""
        if self.spec.pw == 1:
            return {}
        cols = next(w for w in layer.cols if w.member == name)
        return {"cols": cols.row_map(), "pw": self.spec.pw}

    @property
    def grad_group(self) -> Group:
        """Every rank holds the whole parameters: their gradients are summed over all P."""
        return self.ctx.grids.grid(self.ctx.grids.world_size).batch_group

    @property
    def grad_key(self) -> tuple:
        return ("batch", self.ctx.grids.world_size)

    def bn_group(self) -> Group:
        """Every rank holds other rows or other examples: statistics over all P."""
        return self.ctx.grids.twin_group(self.ctx.grids.world_size, "bn", shm=True)

    @property
    def replicated(self) -> bool:
        return False
