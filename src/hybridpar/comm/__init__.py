"""Communication: the process grid, the ledger and every collective hybridpar runs."""

from hybridpar.comm.grid import ProcessGrid, check_grid
from hybridpar.comm.ledger import Ledger

__all__ = ["Ledger", "ProcessGrid", "check_grid"]
