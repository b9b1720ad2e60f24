"""The domain style (Gholami et al. section 2.4, Eqs. 7 and 9): a segment's activations split by
height over the Pr ranks of a model group, the Pc batch groups splitting the examples.

Each rank holds a band of rows of every example of its batch group (`even_split(H, Pr)`, the
first H mod Pr ranks one row more: core.halo.bands). A 2-d convolution or pooling computes
the output rows it owns from its band and the halo rows its window reads from other bands
(core.halo.Window.plan: stride, dilation and padding included; several bands away when a
band is thinner than the halo). Forward, the halo rows are posted as non-blocking point-to-point
sends and receives, the interior output rows (those its own band alone determines) are computed
while they travel, then the border rows; through a host's shared memory, where the rows arrive in
microseconds, the whole band is one call after the halo is in. Backward, the gradients of the halo rows go back to
their owners and are added to their rows. Batch norm takes its statistics over every rank (rows
and examples); element-wise layers run on the band as they are. Parameters are whole on every
rank: their gradients are summed over all P ranks.

On tiles (`domain(HxWxC)`: rank m of the model group holds tile (m // W, m % W) of each image)
a window's halo columns travel first, along the tile's row of tiles, and the tile widened by
them is what the row exchange sends along its column of tiles: the corners come with the rows
(`_Windowed.setup`).

| function        | forward                                       | backward                        | term      |
| --------------- | --------------------------------------------- | ------------------------------- | --------- |
| _Post           | post the sends and receives of halo rows       | receive the gradients of the    | halo_fwd  |
|                 | (non-blocking); the band passes through        | rows sent, add them to the band |           |
| _Wait           | wait for the halo rows                         | send their gradients back       | halo_bwd  |
| transpose       | all-to-all: my examples' bands to their owners | the inverse all-to-all          | redistribute |
|                 | (or back, out of the domain layout)            | (mappings.py)                   |           |
| cut / join      | keep my band (tile) / all-gather them          | all-gather / keep (mappings.py) | redistribute |

The package, one concern a file: `halo.py` (the exchange and its autograd pair), `windows.py`
(the windowed stand-ins), `reductions.py` (global poolings over bands), `moves.py` (into and out
of the layout), `style.py` (DomainStyle: which stand-in each module of a segment gets).

Moves into and out of the domain layout (`MOVES`): from the layout with the same batch groups a
band is kept (its gradient all-gathered backward), from pure batch one all-to-all each way within
the model group (tiles: through the replicated layout), from any other layout through the
replicated layout of the domain grid, and
back the same ways; the cost model (planning.cost.terms.redistribute) prices exactly these.
"""

from hybridpar.runtime.parallel.domain.halo import Exchange
from hybridpar.runtime.parallel.domain.moves import MOVES, cut, join
from hybridpar.runtime.parallel.domain.reductions import SpaceReduction
from hybridpar.runtime.parallel.domain.style import DomainStyle
from hybridpar.runtime.parallel.domain.windows import (
    DomainConv,
    DomainPool,
    DomainResample,
    DomainTransposed,
)

__all__ = [
    "MOVES",
    "DomainConv",
    "DomainPool",
    "DomainResample",
    "DomainStyle",
    "DomainTransposed",
    "Exchange",
    "SpaceReduction",
    "cut",
    "join",
]
