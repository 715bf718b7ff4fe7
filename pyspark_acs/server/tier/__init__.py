"""The tier mover daemon (``acs-tier-mover``): sealed files to the secondary store, retention."""

from pyspark_acs.server.tier.mover import PassReport, TierMover

__all__ = [
    "TierMover",
]
